"""`codex data tokenize`: train a byte-level BPE tokenizer on the cleaned corpus.

    RUN/clean/part-*.parquet (or data.tokenizer.inputs)
      -> pass 1: hash every document, keep the smallest hashes up to max_chars (and the largest
                 `heldout_docs` hashes aside to measure compression)
      -> pass 2: re-read, stream the selected documents into the BPE trainer (data.tokenizer.trainer)
      -> RUN/tokenizer/ tokenizer.json, token_bytes.npy, config.yaml, tokenizer_meta.json (last)

Two trainers, one artifact (an HF `tokenizers` tokenizer.json, loaded and used the same way):
- "rustbpe" (default): nanochat's rustbpe trains; its merges are rebuilt into an HF BPE model
  (`_merge_pairs`, `tokenizer_from_merges`), which encodes exactly as rustbpe does (tested). On
  2 cores it trains 32K tokens on 100 MB in 17 s where HF's BpeTrainer takes 28-31 s and
  sentencepiece 23 s (bench/bench_tokenizer.py): HF spends most of its time building per-byte
  alignment tables for each pre-token, which a trainer never needs. Counts are int32, so it
  refuses more than 2^31-1 bytes of training text (clear error; use "hf").
- "hf": HF tokenizers' BpeTrainer, 64-bit counts, for larger budgets.
Both train byte-level BPE on the same regex and break merge ties by pair ids, so both are
deterministic functions of the documents; they differ only in tie-breaks (same compression to
3 decimals on the bench corpus).

The tokenizer (see ARCHITECTURE.md, "Tokenizer contract"):
- byte-level BPE: the 256 byte symbols are always in the vocabulary, so every string encodes and
  there is no unknown token; no normalizer, so decode(encode(x)) == x for every string x;
- specials take the first ids: <|bos|> = 0, <|eos|> = 1, <|pad|> = 2, then the 256 bytes (rustbpe:
  byte b = id 3 + b), then merged tokens in merge order;
- pre-tokenized with the GPT-4 (cl100k) split regex, digits grouped as \\p{N}{1,3}: a run of digits
  is cut left to right into pieces of at most 3 ("1234567" -> "123" "456" "7"), so no token spans
  more than 3 digits and a number costs at least one token per 3 digits (as GPT-4; nanochat uses
  1-2 for very small vocabularies). The regex also keeps every pre-token small, which is what keeps
  the trainer's memory bounded (tokenizers #1345, #1546);
- a corpus too small to support `vocab_size` tokens gives fewer: the meta records the real size
  (`vocab_size`) next to `vocab_size_requested`, and a warning is logged.

Compression (bytes/token) is measured on held-out documents: the `heldout_docs` largest hashes
(at most a tenth of the corpus), never trained on, encoded up to 2M characters.

Why sample by hash: which documents are used depends only on their text, never on how many shard
files exist or in what order they are listed, so the same documents always give the same
tokenizer.json byte for byte. The BPE trainer's result depends only on the multiset of pre-token
counts (merge ties are broken by token ids), so documents can be streamed in file order.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import json
import logging
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from codex import fsio, rundir
from codex.config import Config, ConfigError, save_config
from codex.progress import Progress

log = logging.getLogger("codex.tokenizer")

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
SPECIAL_IDS = {"bos": 0, "eos": 1, "pad": 2}
# GPT-4 (cl100k_base) split pattern. Digits: \p{N}{1,3}, see the module docstring.
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                 r"""|\s*[\r\n]|\s+(?!\S)|\s+""")
MIN_VOCAB = len(SPECIAL_TOKENS) + 256
READ_BATCH_ROWS = 1024        # parquet rows decoded at a time
COMPRESSION_MAX_CHARS = 2_000_000  # held-out text encoded to measure bytes/token

TOKENIZER_FILE = "tokenizer.json"
TOKEN_BYTES_FILE = "token_bytes.npy"
META_FILE = "tokenizer_meta.json"
FORMAT_VERSION = 1


# --- the tokenizer itself ------------------------------------------------------------------------

def new_tokenizer(model: models.BPE | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer (untrained unless `model` is given): codex's split regex, no normalizer."""
    tok = Tokenizer(model if model is not None else models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        # use_regex=False: the split above replaces ByteLevel's GPT-2 regex; this only maps bytes.
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


TRAINERS = ("rustbpe", "hf")
# rustbpe counts words and pairs in int32: no count can exceed the training text's byte count, so
# up to this many bytes nothing can overflow. Above it, train with trainer="hf" (64-bit counts).
RUSTBPE_MAX_BYTES = 2**31 - 1


def train_tokenizer(texts, vocab_size: int, trainer: str = "rustbpe", length: int | None = None,
                    buffer_docs: int = 1024) -> Tokenizer:
    """Train on an iterator of strings (or of lists of strings); specials get ids 0..2, then the 256 bytes.

    trainer="rustbpe" (default): nanochat's rustbpe counts the pre-tokens and runs the merge loop
    (1.9x faster than HF's BpeTrainer on 2 cores: 14.4 s vs 27.7 s, bench/bench_tokenizer.py);
    its merges become an HF `tokenizers` BPE model, saved and loaded like the other trainer's.
    trainer="hf": HF tokenizers' BpeTrainer. Both are byte-level BPE on the same split regex, and
    both are deterministic functions of the multiset of documents.
    """
    if trainer == "hf":
        return _train_hf(texts, vocab_size, length)
    return _train_rustbpe(texts, vocab_size, buffer_docs)


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
    import rustbpe

    logging.getLogger("rustbpe").addFilter(_every_tenth_percent)  # a no-op when already added
    n_tokens = vocab_size - len(SPECIAL_TOKENS)
    # A few spare merges: rustbpe can (rarely) build the same bytes by two different merges, which
    # makes one token in the HF vocabulary; the spares keep the vocabulary at the size asked for.
    spare = max(16, n_tokens // 256)
    bpe = rustbpe.Tokenizer()
    # rustbpe pulls `buffer_docs` documents at a time under the GIL, then splits and counts them
    # in parallel without it: the buffer bounds memory (documents are capped at doc_max_chars).
    bpe.train_from_iterator(_strings(texts), n_tokens + spare, buffer_size=buffer_docs, pattern=SPLIT_PATTERN)
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
            best = min((rank.get(p, new_id), p) for p in zip(ids, ids[1:]))
            if best[0] == new_id:
                break
            ids = _apply_merge(ids, best[1], best[0])
        if len(ids) != 2 or token_bytes[ids[0]] + token_bytes[ids[1]] != token_bytes[new_id]:
            raise RuntimeError(f"rustbpe: token {new_id} {token_bytes[new_id]!r} is not a merge of two earlier tokens")
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
        pct = msg[len("Progress: "):].split("%", 1)[0]
        return pct.isdigit() and int(pct) % 10 == 0
    return True


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype holding ids 0..vocab_size-1 (vocab 65,536 still fits uint16)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _byte_encoder() -> list[str]:
    """The GPT-2 bytes->unicode map used by the ByteLevel pre-tokenizer: byte b is the char [b]."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _byte_decoder() -> dict[str, int]:
    """Inverse of `_byte_encoder`."""
    return {c: b for b, c in enumerate(_byte_encoder())}


def token_bytes_of(tok: Tokenizer) -> np.ndarray:
    """int32 [vocab_size]: UTF-8 byte length of each token, 0 for the specials (for bits per byte)."""
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


# --- reading documents ---------------------------------------------------------------------------

SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".txt")


def input_files(cfg: Config) -> list[str]:
    """The training files: data.tokenizer.inputs (paths, globs, directories) or RUN/clean/part-*.parquet."""
    inputs = cfg.data.tokenizer.inputs
    if not inputs:
        # Clean's stats.json lists its shards once every task has finished: reading its list, not a
        # glob, never trains on a half-cleaned corpus or a crashed chunk's leftovers.
        from pipeline.clean import finished_files

        return finished_files(rundir.clean_dir(cfg.run))
    files: list[str] = []
    for spec in inputs:
        if any(ch in spec for ch in "*?["):
            found = [f for f in fsio.glob(spec) if f.endswith(SUFFIXES)]
        elif fsio.isdir(spec):
            found = [f for f in fsio.listdir(spec)
                     if f.endswith(SUFFIXES) and not fsio.basename(f).startswith(".")]
        elif fsio.exists(spec):
            if not spec.endswith(SUFFIXES):
                raise ConfigError(f"data.tokenizer.inputs: {spec}: unsupported file type (use {', '.join(SUFFIXES)})")
            found = [spec]
        else:
            raise FileNotFoundError(f"data.tokenizer.inputs: {spec} does not exist")
        if not found:
            raise FileNotFoundError(f"data.tokenizer.inputs: {spec} matches no {'/'.join(SUFFIXES)} files")
        files += found
    return sorted(set(files))


def iter_text_batches(path: str) -> Iterator[list]:
    """Lists of document texts (None for a null row) in file order. .txt = one document."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fsio.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            if "text" not in pf.schema_arrow.names:
                raise ValueError(f"{path}: no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
            for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS, columns=["text"]):
                yield batch.column(0).to_pylist()
    elif ".jsonl" in path:
        batch: list = []
        with fsio.open(path, "rb", compression="infer") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    text = obj["text"]
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
                except (KeyError, TypeError):
                    raise ValueError(f"{path}:{lineno}: no 'text' field") from None
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: 'text' is {type(text).__name__}, not a string")
                batch.append(text)
                if len(batch) >= READ_BATCH_ROWS:
                    yield batch
                    batch = []
        if batch:
            yield batch
    else:
        try:
            yield [fsio.read_bytes(path).decode("utf-8")]
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None


def doc_hash(text: str) -> int:
    """128-bit hash of a document's text: decides selection and order, independent of where it lives."""
    return _hash_utf8(text.encode("utf-8"))


def _hash_utf8(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "big")


# --- pass 1: which documents --------------------------------------------------------------------

@dataclass
class Selection:
    """What pass 1 decided. `train`/`heldout` map file index -> sorted row indices."""
    train: dict[int, list[int]] = field(default_factory=dict)
    heldout: dict[int, list[int]] = field(default_factory=dict)
    train_docs: int = 0
    train_chars: int = 0
    train_bytes: int = 0          # UTF-8 bytes of the training text (rustbpe counts in int32)
    heldout_docs: int = 0
    docs_seen: int = 0
    chars_seen: int = 0           # after the per-document cap
    docs_capped: int = 0          # longer than doc_max_chars, cut
    docs_empty: int = 0           # null or "" rows, skipped
    fingerprint: str = ""         # sha256 over the sorted hashes of the training documents


class HashBudget:
    """Streaming 'smallest hashes until the character budget'.

    Keeps exactly the longest prefix, in hash order, of the documents seen so far whose characters
    fit in `budget`: a max-heap of the kept ones; when over budget the largest hash is evicted and
    becomes a ceiling (anything at or above it can never fit again). Memory: the kept documents.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self.heap: list[tuple[int, int, int, int, int]] = []  # (-hash, chars, file, row, bytes)
        self.chars = 0
        self.ceiling: int | None = None

    def offer(self, h: int, chars: int, file: int, row: int, nbytes: int = 0) -> None:
        if self.ceiling is not None and h >= self.ceiling:
            return
        heapq.heappush(self.heap, (-h, chars, file, row, nbytes))
        self.chars += chars
        while self.chars > self.budget:
            neg, c, *_ = heapq.heappop(self.heap)
            self.chars -= c
            self.ceiling = -neg

    def kept(self) -> list[tuple[int, int, int, int, int]]:
        """(hash, chars, file, row, bytes) in hash order."""
        return sorted((-neg, c, f, r, b) for neg, c, f, r, b in self.heap)


def select_documents(files: list[str], max_chars: int, doc_max_chars: int, heldout_docs: int) -> Selection:
    """Pass 1: hash every document; training = smallest hashes within max_chars, held out = largest.

    Held-out documents (at most a tenth of the corpus) are never trained on, so the reported
    compression is on unseen text.
    """
    budget = HashBudget(max_chars)
    top: list[tuple[int, int, int]] = []  # min-heap of the largest hashes: (hash, file, row)
    sel = Selection()
    with Progress("tokenize: scan", total=len(files), unit="files") as p:
        for fi, path in enumerate(files):
            row = 0
            nchars = 0
            for texts in iter_text_batches(path):
                for text in texts:
                    r, row = row, row + 1
                    if not text:
                        sel.docs_empty += 1
                        continue
                    try:
                        data = text.encode("utf-8")
                    except UnicodeEncodeError as e:
                        raise ValueError(f"{path}: row {r}: text is not valid Unicode ({e.reason} at {e.start})") from None
                    h = _hash_utf8(data)
                    capped = len(text) > doc_max_chars
                    chars = doc_max_chars if capped else len(text)
                    nbytes = len(text[:doc_max_chars].encode("utf-8")) if capped else len(data)
                    sel.docs_capped += capped
                    sel.docs_seen += 1
                    sel.chars_seen += chars
                    nchars += len(text)
                    budget.offer(h, chars, fi, r, nbytes)
                    if heldout_docs:
                        if len(top) < heldout_docs:
                            heapq.heappush(top, (h, fi, r))
                        elif h > top[0][0]:
                            heapq.heapreplace(top, (h, fi, r))
            p.update(1, docs=row, chars=nchars)
    # Hold out at most a tenth of the documents: a tiny corpus still trains on 90% of its text.
    top.sort(reverse=True)
    top = top[: min(heldout_docs, sel.docs_seen // 10)]
    held_hashes = {h for h, _, _ in top}
    for _, fi, r in top:
        sel.heldout.setdefault(fi, []).append(r)
    fp = hashlib.sha256()
    for h, chars, fi, r, nbytes in budget.kept():
        if h in held_hashes:  # also drops exact duplicates of a held-out document
            continue
        sel.train.setdefault(fi, []).append(r)
        sel.train_docs += 1
        sel.train_chars += chars
        sel.train_bytes += nbytes
        fp.update(h.to_bytes(16, "big"))
    for rows in (*sel.train.values(), *sel.heldout.values()):
        rows.sort()
    sel.heldout_docs = len(top)
    sel.fingerprint = fp.hexdigest()
    return sel


# --- pass 2: read the selected texts --------------------------------------------------------------

def iter_selected(files: list[str], train_rows: dict[int, list[int]], heldout_rows: dict[int, list[int]],
                  doc_max_chars: int, heldout_out: list[str], total_docs: int) -> Iterator[str]:
    """Training texts one at a time, capped per document; collects held-out texts.

    One document per item, not lists: measured on the demo corpus x3, the Rust trainer took 16.8 s
    fed single documents, 18.6 s fed a Python list and 19.2 s fed 4M-character lists."""
    with Progress("tokenize: train (feeding)", total=total_docs, unit="docs") as p:
        for fi, path in enumerate(files):
            want = set(train_rows.get(fi, ()))
            held = set(heldout_rows.get(fi, ()))
            if not want and not held:
                continue
            row = 0
            for texts in iter_text_batches(path):
                n_docs = n_chars = 0
                for text in texts:
                    if row in want:
                        text = text[:doc_max_chars]
                        n_docs += 1
                        n_chars += len(text)
                        yield text
                    elif row in held:
                        heldout_out.append(text[:doc_max_chars])
                    row += 1
                p.update(n_docs, chars=n_chars)


def compression(tok: Tokenizer, texts: list[str], max_chars: int = COMPRESSION_MAX_CHARS) -> dict:
    """Bytes per token of `texts` (UTF-8 bytes / tokens, no specials), on at most `max_chars`.

    Why a cap: encoding is ~3 MB/s a core; 500 long held-out documents took 16 s on 2 cores
    (a fifth of a 100 MB training run), and 2M characters already give a stable ratio.
    """
    each = max(max_chars // max(len(texts), 1), 1)
    texts = [t[:each] for t in texts]
    if not texts:
        return {"bytes_per_token": None, "docs": 0, "bytes": 0, "tokens": 0}
    tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    return {"bytes_per_token": round(nbytes / max(tokens, 1), 4), "docs": len(texts), "bytes": nbytes, "tokens": tokens}


# --- the stage ----------------------------------------------------------------------------------

def _settings(cfg: Config) -> dict:
    t = cfg.data.tokenizer
    return {"vocab_size": t.vocab_size, "max_chars": t.max_chars, "doc_max_chars": t.doc_max_chars,
            "heldout_docs": t.heldout_docs, "trainer": t.trainer, "split_pattern": SPLIT_PATTERN,
            "format_version": FORMAT_VERSION}


def _validate(cfg: Config) -> None:
    t = cfg.data.tokenizer
    if t.vocab_size < MIN_VOCAB:
        raise ConfigError(f"data.tokenizer.vocab_size={t.vocab_size}: must be at least {MIN_VOCAB} "
                          f"({len(SPECIAL_TOKENS)} specials + 256 bytes)")
    if t.vocab_size >= 2**32:
        raise ConfigError(f"data.tokenizer.vocab_size={t.vocab_size}: must be below 2**32")
    for key in ("max_chars", "doc_max_chars"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"data.tokenizer.{key}={getattr(t, key)}: must be positive")
    if t.heldout_docs < 0:
        raise ConfigError(f"data.tokenizer.heldout_docs={t.heldout_docs}: must be >= 0")


def _peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS. It is this process's peak so far.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)


def _up_to_date(out: str, settings: dict, inputs: list[dict]) -> dict | None:
    """The existing meta when RUN/tokenizer was made from the same settings and input files."""
    meta_path = fsio.join(out, META_FILE)
    if not fsio.exists(meta_path):
        return None
    try:
        meta = fsio.read_json(meta_path)
        same = meta.get("settings") == settings and meta.get("inputs") == inputs
        if same and hashlib.sha256(fsio.read_bytes(fsio.join(out, TOKENIZER_FILE))).hexdigest() == meta["sha256"] \
                and fsio.exists(fsio.join(out, TOKEN_BYTES_FILE)):
            return meta
    except (ValueError, KeyError, FileNotFoundError):
        pass  # unreadable or partial: train again
    return None


def _refuse_if_built_on(run: str, out: str) -> None:
    """Retraining would replace a tokenizer that shards or checkpoints were made with: their token
    ids would silently mean other text. Refuse (exit 2), as clean and shard do for their outputs."""
    if not fsio.exists(fsio.join(out, META_FILE)):
        return
    built = [d for d in (rundir.shards_dir(run), rundir.checkpoints_dir(run))
             if fsio.exists(fsio.join(d, "manifest.json")) or (fsio.isdir(d) and fsio.listdir(d))]
    if built:
        raise ConfigError(f"{out} would be retrained (its settings or inputs changed), but {' and '.join(built)} "
                          f"were built with the current tokenizer; to start over use a new --run, or delete "
                          f"{' and '.join(built)} and {out} first")


def run_tokenizer(cfg: Config) -> dict:
    """Train the tokenizer for cfg.run and write RUN/tokenizer/; returns tokenizer_meta.json's dict.

    A rerun with the same settings and input files returns the existing result without training.
    """
    _validate(cfg)
    t = cfg.data.tokenizer
    t0 = time.perf_counter()
    out = rundir.tokenizer_dir(cfg.run)
    files = input_files(cfg)
    inputs = [{"path": f, "bytes": fsio.size(f)} for f in files]
    settings = _settings(cfg)
    done = _up_to_date(out, settings, inputs)
    if done is not None:
        log.info("tokenizer in %s is up to date (vocab %d, sha256 %s); nothing to do", out, done["vocab_size"], done["sha256"][:12])
        return done
    _refuse_if_built_on(cfg.run, out)

    log.info("tokenize: %d input files, vocab %d, budget %d chars", len(files), t.vocab_size, t.max_chars)
    sel = select_documents(files, t.max_chars, t.doc_max_chars, t.heldout_docs)
    if sel.train_docs == 0:
        raise ValueError(f"no training text: {sel.docs_seen} non-empty documents in {len(files)} files "
                         f"and none fits data.tokenizer.max_chars={t.max_chars}")
    log.info("tokenize: training on %d of %d documents (%d chars, %d capped at %d chars), %d held out",
             sel.train_docs, sel.docs_seen, sel.train_chars, sel.docs_capped, t.doc_max_chars, sel.heldout_docs)
    if t.trainer == "rustbpe" and sel.train_bytes > RUSTBPE_MAX_BYTES:
        raise ConfigError(f"data.tokenizer.trainer=rustbpe counts in 32-bit integers: at most {RUSTBPE_MAX_BYTES:,} "
                          f"bytes of training text, and data.tokenizer.max_chars={t.max_chars:,} selected "
                          f"{sel.train_bytes:,}; lower max_chars or set data.tokenizer.trainer=hf")
    t_scan = time.perf_counter() - t0

    heldout: list[str] = []
    # rustbpe's buffer: ~64M characters of documents at a time (memory), at least 64 (parallelism).
    buffer_docs = max(64, min(8192, 64_000_000 // t.doc_max_chars))
    tok = train_tokenizer(iter_selected(files, sel.train, sel.heldout, t.doc_max_chars, heldout, sel.train_docs),
                          t.vocab_size, trainer=t.trainer, buffer_docs=buffer_docs)
    t_train = time.perf_counter() - t0 - t_scan
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    for name, i in SPECIAL_IDS.items():
        got = tok.token_to_id(SPECIAL_TOKENS[i])
        if got != i:
            raise RuntimeError(f"special token {SPECIAL_TOKENS[i]} got id {got}, expected {i}")
    if vocab_size < t.vocab_size:
        log.warning("tokenize: the corpus only supports %d tokens (asked for %d): no pair left to merge; "
                    "meta records vocab_size=%d", vocab_size, t.vocab_size, vocab_size)

    tok.encode_special_tokens = True  # compression of plain text: "<|bos|>" in a document is text
    text = tok.to_str(pretty=True)
    token_bytes = token_bytes_of(tok)
    if heldout:
        comp = {**compression(tok, heldout), "sample": "heldout"}
    elif t.heldout_docs == 0:
        comp = {**compression(tok, []), "sample": "none"}
    else:  # fewer than 10 documents, none could be held out: measure on (tiny) training text, say so
        log.warning("tokenize: %d documents, too few to hold any out; compression measured on training text",
                    sel.docs_seen)
        sample = list(iter_selected(files, sel.train, {}, t.doc_max_chars, [], sel.train_docs))
        comp = {**compression(tok, sample[: t.heldout_docs]), "sample": "training"}

    meta = {
        "format_version": FORMAT_VERSION,
        "vocab_size": vocab_size,
        "vocab_size_requested": t.vocab_size,
        "token_dtype": token_dtype(vocab_size),
        "special_ids": dict(SPECIAL_IDS),
        "special_tokens": {name: SPECIAL_TOKENS[i] for name, i in SPECIAL_IDS.items()},
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "split_pattern": SPLIT_PATTERN,
        "corpus": {
            "fingerprint": sel.fingerprint,
            "files": len(files),
            "docs_seen": sel.docs_seen,
            "docs_empty": sel.docs_empty,
            "docs_capped": sel.docs_capped,
            "chars_seen": sel.chars_seen,
            "docs_used": sel.train_docs,
            "chars_used": sel.train_chars,
            "bytes_used": sel.train_bytes,
            "heldout_docs": sel.heldout_docs,
        },
        "chars_used": sel.train_chars,
        "compression": comp,
        "peak_rss_mb": _peak_rss_mb(),
        "seconds": {"scan": round(t_scan, 2), "train": round(t_train, 2),
                    "total": round(time.perf_counter() - t0, 2)},
        "trainer": t.trainer,
        "tokenizers_version": _version("tokenizers"),
        **({"rustbpe_version": _version("rustbpe")} if t.trainer == "rustbpe" else {}),
        "settings": settings,
        "inputs": inputs,
    }
    # Meta is the commit marker: remove the old one first, write it last.
    fsio.makedirs(out)
    fsio.rm(fsio.join(out, META_FILE))
    fsio.write_text(fsio.join(out, TOKENIZER_FILE), text)
    buf = io.BytesIO()
    np.save(buf, token_bytes)
    fsio.write_bytes(fsio.join(out, TOKEN_BYTES_FILE), buf.getvalue())
    save_config(cfg, fsio.join(out, "config.yaml"))
    fsio.write_json(fsio.join(out, META_FILE), meta)
    log.info("tokenize: vocab %d, %.2f bytes/token on %d %s docs, peak RSS %.0f MB, %.1fs -> %s",
             vocab_size, comp["bytes_per_token"] or 0, comp["docs"], comp["sample"], meta["peak_rss_mb"],
             meta["seconds"]["total"], out)
    return meta


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# --- loading ------------------------------------------------------------------------------------

def load_meta(tokenizer_dir: str) -> dict:
    path = fsio.join(tokenizer_dir, META_FILE)
    if not fsio.exists(path):
        raise FileNotFoundError(f"{path} not found: {tokenizer_dir} is not a finished tokenizer "
                                f"(run `codex data tokenize`)")
    return fsio.read_json(path)


def load_tokenizer(tokenizer_dir: str) -> Tokenizer:
    """The trained tokenizer, checked against its meta, with encode_special_tokens=True.

    encode_special_tokens is not saved in tokenizer.json, and without it a literal "<|bos|>" inside
    a document would become a fake document boundary; with it, such text is encoded as plain bytes
    and special ids only ever come from code that inserts them on purpose.
    """
    meta = load_meta(tokenizer_dir)
    path = fsio.join(tokenizer_dir, TOKENIZER_FILE)
    data = fsio.read_bytes(path)
    digest = hashlib.sha256(data).hexdigest()
    if digest != meta["sha256"]:
        raise ValueError(f"{path}: sha256 {digest[:12]} does not match {META_FILE} ({meta['sha256'][:12]}); "
                         f"the tokenizer was modified or half-rewritten: rerun `codex data tokenize`")
    tok = Tokenizer.from_str(data.decode("utf-8"))
    tok.encode_special_tokens = True
    if tok.get_vocab_size(with_added_tokens=True) != meta["vocab_size"]:
        raise ValueError(f"{path}: vocab size {tok.get_vocab_size()} != {META_FILE} vocab_size {meta['vocab_size']}")
    return tok


def load_token_bytes(tokenizer_dir: str) -> np.ndarray:
    """int32 [vocab_size]: UTF-8 bytes of each token, 0 for specials."""
    path = fsio.join(tokenizer_dir, TOKEN_BYTES_FILE)
    if not fsio.exists(path):
        raise FileNotFoundError(f"{path} not found (run `codex data tokenize`)")
    arr = np.load(io.BytesIO(fsio.read_bytes(path)), allow_pickle=False)
    if arr.ndim != 1 or arr.dtype != np.int32:
        raise ValueError(f"{path}: expected int32 [vocab_size], got {arr.dtype} {arr.shape}")
    return arr
