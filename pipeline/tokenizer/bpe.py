"""Byte-level BPE: the tokenizer codex trains, and the two trainers that make it.

The 256 bytes are always in the vocabulary and there is no normalizer, so every string encodes
and decode(encode(x)) == x. The specials take the first ids, then the bytes, then the merges. The
split regex is GPT-4's, with digits in groups of at most 3. Two trainers make the same kind of
tokenizer.json: "rustbpe" (the default, int32 counts) and "hf" (HF's BpeTrainer, 64-bit counts).
Both break merge ties by pair ids, so both are deterministic functions of the documents.
docs/stages.md, "tokenize", has the details.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from codex.core.config import ConfigError

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
SPECIAL_IDS = {"bos": 0, "eos": 1, "pad": 2}
# GPT-4 (cl100k_base) split pattern. Digits: \p{N}{1,3} (docs/stages.md, "The tokenizer").
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)
MIN_VOCAB = len(SPECIAL_TOKENS) + 256


def new_tokenizer(model: models.BPE | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer (untrained unless `model` is given): codex's split regex, no
    normalizer."""
    tok = Tokenizer(model if model is not None else models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            # use_regex=False: the split above replaces ByteLevel's GPT-2 regex; this only maps
            # bytes.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


TRAINERS = ("rustbpe", "hf")
# rustbpe counts words and pairs in int32: no count can exceed the training text's byte count, so
# up to this many bytes nothing can overflow. Above it, train with trainer="hf" (64-bit counts).
RUSTBPE_MAX_BYTES = 2**31 - 1


def train_tokenizer(
    texts,
    vocab_size: int,
    trainer: str = "rustbpe",
    length: int | None = None,
    buffer_docs: int = 1024,
) -> Tokenizer:
    """Train on an iterator of strings (or of lists of strings); specials get ids 0..2, then the
    256 bytes.

    trainer="rustbpe" (default): nanochat's rustbpe counts the pre-tokens and runs the merge loop
    (faster than HF's BpeTrainer: bench/bench_tokenizer.py, figures in README);
    its merges become an HF `tokenizers` BPE model, saved and loaded like the other trainer's.
    trainer="hf": HF tokenizers' BpeTrainer. Both are byte-level BPE on the same split regex, and
    both are deterministic functions of the multiset of documents.
    """
    if trainer == "hf":
        return _train_hf(texts, vocab_size, length)
    if trainer == "rustbpe":
        return _train_rustbpe(texts, vocab_size, buffer_docs)
    raise ConfigError(f"data.tokenizer.trainer={trainer!r}: must be one of {', '.join(TRAINERS)}")


def _train_hf(texts, vocab_size: int, length: int | None) -> Tokenizer:
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=0,
        show_progress=sys.stderr.isatty(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def _strings(texts) -> Iterator[str]:
    for item in texts:
        if isinstance(item, str):
            yield item
        else:
            yield from item


def _train_rustbpe(texts, vocab_size: int, buffer_docs: int) -> Tokenizer:
    logging.getLogger("rustbpe").addFilter(_every_tenth_percent)  # a no-op when already added
    n_tokens = vocab_size - len(SPECIAL_TOKENS)
    # A few spare merges: rustbpe can (rarely) build the same bytes by two different merges, which
    # makes one token in the HF vocabulary; the spares keep the vocabulary at the size asked for.
    spare = max(16, n_tokens // 256)
    import rustbpe  # only the tokenize stage trains: other commands run without it

    bpe = rustbpe.Tokenizer()
    # rustbpe pulls `buffer_docs` documents at a time under the GIL, then splits and counts them
    # in parallel without it: the buffer bounds memory (documents are capped at doc_max_chars).
    bpe.train_from_iterator(
        _strings(texts), n_tokens + spare, buffer_size=buffer_docs, pattern=SPLIT_PATTERN
    )
    ranks = sorted(bpe.get_mergeable_ranks(), key=lambda item: item[1])
    return tokenizer_from_merges(_merge_pairs([b for b, _ in ranks]), vocab_size)


def _merge_pairs(token_bytes: list[bytes]) -> list[tuple[int, int]]:
    """Which pair of earlier tokens each merged token (rank >= 256) was made from.

    rustbpe gives each token's bytes by rank, not the pair that was merged. The pair is recovered
    exactly by encoding the token's bytes with the merges before it: no merge ever crosses the edges
    of the two tokens being merged (tokens are never split), so the training process inside that
    span is the same as encoding the span alone, which must end in exactly those two tokens.
    """
    if [bytes([i]) for i in range(256)] != token_bytes[:256]:
        raise RuntimeError("rustbpe: the first 256 ranks are not the 256 single bytes")
    rank: dict[tuple[int, int], int] = {}
    pairs: list[tuple[int, int]] = []
    for new_id in range(256, len(token_bytes)):
        ids = list(token_bytes[new_id])
        while len(ids) > 2:
            best = min((rank.get(p, new_id), p) for p in zip(ids, ids[1:], strict=False))
            if best[0] == new_id:
                break
            ids = _apply_merge(ids, best[1], best[0])
        if len(ids) != 2 or token_bytes[ids[0]] + token_bytes[ids[1]] != token_bytes[new_id]:
            raise RuntimeError(
                f"rustbpe: token {new_id} {token_bytes[new_id]!r} "
                "is not a merge of two earlier tokens"
            )
        rank[(ids[0], ids[1])] = new_id
        pairs.append((ids[0], ids[1]))
    return pairs


def _apply_merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Merge every non-overlapping occurrence of `pair`, left to right (as training does)."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def tokenizer_from_merges(pairs: list[tuple[int, int]], vocab_size: int) -> Tokenizer:
    """An HF byte-level BPE tokenizer from merges over byte ids (0..255 bytes, 256+k = k-th merge).

    Layout: specials 0..2, byte b at id 3 + b, then merged tokens in merge order, up to vocab_size.
    A merge that rebuilds bytes already in the vocabulary (a second way to the same token) is kept
    as a merge but adds no token, as HF's own trainer does.
    """
    to_char = _byte_encoder()
    strings = [to_char[b] for b in range(256)]
    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    for s in strings:
        vocab[s] = len(vocab)
    merges: list[tuple[str, str]] = []
    for a, b in pairs:
        if len(vocab) >= vocab_size:
            break
        merged = strings[a] + strings[b]
        strings.append(merged)
        merges.append((strings[a], strings[b]))
        vocab.setdefault(merged, len(vocab))
    tok = new_tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _every_tenth_percent(record: logging.LogRecord) -> bool:
    """rustbpe logs (through Python logging) a line per 1% of merges: keep every 10th."""
    msg = record.getMessage()
    if msg.startswith("Progress: "):
        pct = msg[len("Progress: ") :].split("%", 1)[0]
        return pct.isdigit() and int(pct) % 10 == 0
    return True


def _byte_encoder() -> list[str]:
    """The GPT-2 bytes->unicode map used by the ByteLevel pre-tokenizer: byte b is the char [b]."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def _byte_decoder() -> dict[str, int]:
    """Inverse of `_byte_encoder`."""
    return {c: b for b, c in enumerate(_byte_encoder())}


def token_bytes_of(tok: Tokenizer) -> np.ndarray:
    """int32 [vocab_size]: UTF-8 byte length of each token, 0 for the specials (for bits per
    byte)."""
    byte_of = _byte_decoder()
    vocab = tok.get_vocab(with_added_tokens=True)
    n = tok.get_vocab_size(with_added_tokens=True)
    if sorted(vocab.values()) != list(range(n)):
        raise ValueError(f"tokenizer ids are not contiguous 0..{n - 1}")
    out = np.zeros(n, dtype=np.int32)
    specials = set(SPECIAL_TOKENS)
    for token, i in vocab.items():
        if token in specials:
            continue
        try:
            out[i] = len(bytes(byte_of[c] for c in token))
        except KeyError:
            raise ValueError(f"token {i} {token!r} is not a byte-level token") from None
    return out
