"""Documents -> token ids, the one way codex does it (`codex data shard` and `codex eval --data`).

    document --split_long_text--> pieces of <= chunk_chars (BPE on one huge string is quadratic)
             --encode--> ids of each piece, concatenated (decodes back to the document)
             --frame--> <|bos|> + ids (+ <|eos|>)

The ids are always those of the run's tokenizer.json. `Encoder.backend` "auto" computes them with
tiktoken where `exact_encoding` proves it exact, else with HF tokenizers; "hf" always uses HF.
docs/stages.md, "The encoder", has the details.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import numpy as np
from tokenizers import Tokenizer

if TYPE_CHECKING:
    import tiktoken

log = logging.getLogger("codex.encode")
BACKENDS = ("auto", "hf")
# What an Encoder encodes with (Encoder.load): tiktoken where exact, else HF tokenizers.
EncodeWith = Union["tiktoken.Encoding", Tokenizer]
# A piece's ids: a uint32 array from tiktoken, a list from HF tokenizers.
Ids = np.ndarray | list[int]


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype holding ids 0..vocab_size-1 (vocab 65,536 still fits uint16)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def split_long_text(text: str, limit: int) -> list[str]:
    """Cut `text` into pieces of <= limit characters whose concatenation is `text`.

    Cut after a newline where possible, else before a space (the GPT-4 split regex starts a word
    with its leading space, so both are places where the pre-tokenizer splits anyway), else hard
    at `limit`. Byte-level BPE decodes token by token, so the concatenated ids of the pieces always
    decode back to exactly `text`.
    """
    if len(text) <= limit:
        return [text]
    pieces, start, n = [], 0, len(text)
    while n - start > limit:
        end = start + limit
        cut = text.rfind("\n", start + limit // 2, end)
        if cut != -1:
            cut += 1
        else:
            cut = text.rfind(" ", start + limit // 2, end)
            if cut <= start:
                cut = end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


@dataclass
class Encoder:
    """Everything a worker process needs to encode documents (picklable: the tokenizer as JSON)."""

    tokenizer_json: str
    bos: int
    eos: int
    append_eos: bool
    dtype: str
    chunk_chars: int
    backend: str = "auto"  # "auto": tiktoken where exact, else HF tokenizers (logged); "hf"

    def load(self) -> EncodeWith:
        """What `encode` encodes with: a tiktoken Encoding (backend "auto", where it gives exactly
        tokenizer.json's ids) or an HF Tokenizer with encode_special_tokens=True."""
        if self.backend not in BACKENDS:
            raise ValueError(f"Encoder.backend={self.backend!r}: one of {', '.join(BACKENDS)}")
        if self.backend == "auto":
            enc, why = exact_encoding(self.tokenizer_json)
            if enc is not None:
                return enc
            log.warning("encode: HF tokenizers, not tiktoken: %s", why)
        tok = Tokenizer.from_str(self.tokenizer_json)
        # a literal "<|bos|>" in a document is text, not a boundary
        tok.encode_special_tokens = True
        return tok

    def encode(self, tok: EncodeWith, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat token ids of all documents, tokens per document), each document with its
        specials; `tok` is what `load` returned (or an HF Tokenizer with
        encode_special_tokens=True)."""
        pieces, first, last = [], [], []
        for text in texts:
            parts = split_long_text(text, self.chunk_chars)
            first += [True] + [False] * (len(parts) - 1)
            last += [False] * (len(parts) - 1) + [True]
            pieces += parts
        bos, eos = np.array([self.bos], np.uint32), np.array([self.eos], np.uint32)
        seqs: list[Ids] = []
        doc_starts: list[int] = []
        for ids, is_first, is_last in zip(encode_pieces(tok, pieces), first, last, strict=True):
            if is_first:
                doc_starts.append(len(seqs))
                seqs.append(bos)
            seqs.append(ids)
            if is_last and self.append_eos:
                seqs.append(eos)
        lengths = np.fromiter(map(len, seqs), np.int64, len(seqs))
        # ids < vocab_size, which token_dtype holds: the cast only narrows
        flat = (
            np.concatenate(seqs, dtype=self.dtype, casting="unsafe")
            if seqs
            else np.zeros(0, self.dtype)
        )
        per_doc = np.add.reduceat(lengths, doc_starts) if doc_starts else np.zeros(0, np.int64)
        return flat, per_doc


def encode_pieces(tok: EncodeWith, pieces: list[str]) -> list[Ids]:
    """The ids of each piece, no specials added: HF tokenizers' encode_batch_fast (lists), or
    tiktoken's ordinary encoding (uint32 arrays, ordinary_ids) on as many threads as HF would
    use."""
    if isinstance(tok, Tokenizer):
        # add_special_tokens=False: the documents' specials are ours to place, not a
        # post-processor's
        return [e.ids for e in tok.encode_batch_fast(pieces, add_special_tokens=False)]
    threads = _threads()
    if threads <= 1 or len(pieces) < 2:
        return [ordinary_ids(tok, p) for p in pieces]
    with ThreadPoolExecutor(threads) as pool:  # tiktoken lets go of the GIL while it encodes
        return list(pool.map(functools.partial(ordinary_ids, tok), pieces))


def ordinary_ids(enc: tiktoken.Encoding, text: str) -> np.ndarray:
    """enc.encode_ordinary(text) as a uint32 array (read-only: tiktoken's buffer): a special
    token's text is text (no special is allowed, none refused); tiktoken's buffer becomes the
    array directly, not through a list of one Python int per token, which shard would only
    flatten into an array again."""
    try:
        return enc.encode_to_numpy(text, disallowed_special=())
    except UnicodeEncodeError:  # a lone surrogate: made valid, as encode_ordinary does
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return enc.encode_to_numpy(text, disallowed_special=())


def _threads() -> int:
    """The threads HF tokenizers would encode a batch on here: 1 when TOKENIZERS_PARALLELISM is
    off, else RAYON_NUM_THREADS (set by shard's workers and Ray tasks), else every core."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("0", "false", "off", "no"):
        return 1
    n = os.environ.get("RAYON_NUM_THREADS", "")
    if n.isdigit() and int(n) > 0:
        return int(n)
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


# --- the exact tiktoken Encoding -----------------------------------------------------------------
# tokenizer.json -> a tiktoken Encoding that gives exactly its ids, or the reason it cannot.
#
# tiktoken encodes several times faster than HF tokenizers (nanochat trains with rustbpe and encodes
# with tiktoken). The Encoding is built as nanochat builds one: mergeable_ranks = each token's raw
# bytes -> its id (the tokenizer.json's vocabulary mapped back from HF's byte-level unicode
# alphabet), the same split regex, and the specials as special tokens (never produced by
# encode_ordinary: a "<|bos|>" typed in a document is text, as with HF's
# encode_special_tokens=True).
#
# Why the ids are exactly HF's. HF's BPE repeatedly merges the adjacent pair with the lowest merge
# rank (leftmost first); tiktoken repeatedly merges the adjacent pair whose concatenation has the
# lowest id, whether or not that pair is the token's merge. `exact_encoding` checks:
# 1. the setup codex builds (bpe.new_tokenizer): no normalizer, truncation, padding or
#    post-processor, the pre-tokenizer Split(SPLIT_PATTERN, isolated) + ByteLevel(use_regex=False),
#    a ByteLevel decoder, a plain BPE model (no dropout, unk, prefixes/suffixes, byte fallback,
#    ignore_merges), and only special added tokens (encode_special_tokens=True skips them all);
# 2. ranks consistent with ids: every non-special token is a single byte (all 256 present) or the
#    result of exactly one merge, and merge order is id order, so a merge's rank and its token's id
#    order the pairs alike;
# 3. each merge is the pair tiktoken itself forms: BPE on the token's bytes with the tokens of lower
#    id ends in exactly the merge's two parts (what bpe._merge_pairs builds rustbpe's merges from).
# Under 3, tiktoken's run on any span ends its formation of a token t with t's own merge (the run
# inside t's span is the run on t alone, which is the run with the lower ids followed by t's merge),
# so every merge tiktoken makes is a merge of the list, with the same order: it is HF's run step for
# step. The split regex: tiktoken's engine (fancy-regex) and HF's (Oniguruma) class every code
# point alike (tests/pipeline/test_encode.py encodes all 1.1M of them in context on both), and the
# pattern
# leaves no gap between matches (tiktoken drops what no match covers; every character is a letter,
# a number, a space or none of these, and each has its branch).


def _expected_pre_tokenizer() -> dict:
    from codex.pipeline.tokenizer.bpe import SPLIT_PATTERN

    return {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": SPLIT_PATTERN},
                "behavior": "Isolated",
                "invert": False,
            },
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
        ],
    }


def _same_shape(got: Any, want: Any) -> bool:
    """`got` has every key of `want` with the same value (keys want does not name are free:
    ByteLevel's trim_offsets only moves offsets)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(
            k in got and _same_shape(got[k], v) for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(_same_shape(g, w) for g, w in zip(got, want, strict=True))
        )
    return got == want


def _setup_problem(cfg: dict) -> str | None:
    """Why this tokenizer.json is not the setup codex builds, or None."""
    for key in ("normalizer", "truncation", "padding", "post_processor"):
        if cfg.get(key) is not None:
            return f"it has a {key}"
    if not _same_shape(cfg.get("pre_tokenizer"), _expected_pre_tokenizer()):
        return "its pre-tokenizer is not codex's split regex + byte-level mapping"
    if (cfg.get("decoder") or {}).get("type") != "ByteLevel":
        return "its decoder is not ByteLevel"
    model = cfg.get("model") or {}
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not BPE"
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"its BPE model sets {key}"
    for key in ("fuse_unk", "byte_fallback", "ignore_merges"):
        if model.get(key):
            return f"its BPE model sets {key}"
    if not all(t.get("special") for t in cfg.get("added_tokens") or []):
        return "it has added tokens that are not special"
    return None


def _merge_parts(m) -> tuple[str, str] | None:
    parts = m.split(" ") if isinstance(m, str) else m
    return (parts[0], parts[1]) if isinstance(parts, list) and len(parts) == 2 else None


def _byte_level_table() -> dict[int, str]:
    """str.translate table: a byte-level token's characters -> the characters of its bytes (then
    latin-1 gives the bytes); any other character below 256 -> one above, so that latin-1 refuses
    it as it refuses every character outside the byte-level alphabet."""
    from codex.pipeline.tokenizer.bpe import _byte_decoder

    table = {c: "\U0010ffff" for c in range(256)}
    table.update({ord(c): chr(b) for c, b in _byte_decoder().items()})
    return table


def _ranks_problem(model: dict, specials: dict[str, int]) -> tuple[str | None, dict[bytes, int]]:
    """(why merges and ids are not consistent (or None), mergeable_ranks)."""
    table = _byte_level_table()

    def to_bytes(s: str) -> bytes:
        return s.translate(table).encode("latin-1")  # UnicodeEncodeError: not byte-level

    ranks: dict[bytes, int] = {}
    for s, i in model["vocab"].items():
        if s in specials:
            continue
        try:
            ranks[to_bytes(s)] = i
        except UnicodeEncodeError:
            return f"token {i} {s!r} is not a byte-level token", {}
    if len(set(ranks.values())) != len(ranks) or set(ranks.values()) & set(specials.values()):
        return "two tokens share an id", {}
    if sum(len(b) == 1 for b in ranks) != 256:
        return "not all 256 bytes are tokens", {}
    last = -1
    made: set[bytes] = set()
    for k, m in enumerate(model["merges"]):
        parts = _merge_parts(m)
        if parts is None:
            return f"merge {k} is not a pair", {}
        try:
            a, b = to_bytes(parts[0]), to_bytes(parts[1])
        except UnicodeEncodeError:
            return f"merge {k} is not byte-level", {}
        t = a + b
        rank = ranks.get(t)
        if rank is None or a not in ranks or b not in ranks:
            return f"merge {k} {parts} makes or uses a token outside the vocabulary", {}
        if t in made:
            return f"merge {k} {parts} makes a token an earlier merge made", {}
        if rank <= last:
            return f"merge {k} {parts} has a lower id than the merge before it", {}
        if _bpe_below(t, rank, ranks) != [a, b]:
            return f"merge {k} {parts} is not the pair BPE forms with the lower ids", {}
        made.add(t)
        last = rank
    if len(made) != sum(len(b) > 1 for b in ranks):
        return "a multi-byte token is not the result of any merge", {}
    return None, ranks


def _bpe_below(token: bytes, below: int, ranks: dict[bytes, int]) -> list[bytes]:
    """tiktoken's BPE on `token`'s bytes with only the tokens whose id is below `below`: repeatedly
    merge the adjacent pair whose concatenation has the lowest id (leftmost on a tie)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:  # two parts can only merge into `token` itself
        best, at = below, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], below)
            if r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def exact_encoding(tokenizer_json: str):
    """(tiktoken.Encoding giving exactly tokenizer.json's ids for every string, None) or
    (None, why not). docs/stages.md, "The encoder", lists what must hold."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    try:
        cfg = json.loads(tokenizer_json)
    except ValueError as e:
        return None, f"tokenizer.json is not JSON ({e})"
    problem = _setup_problem(cfg)
    if problem is not None:
        return None, problem
    specials = {t["content"]: t["id"] for t in cfg.get("added_tokens") or []}
    problem, ranks = _ranks_problem(cfg["model"], specials)
    if problem is not None:
        return None, problem
    pattern = cfg["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    enc = tiktoken.Encoding(
        "codex", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
    )
    # tiktoken < 0.11's encode_to_numpy made a special's text the special (pyproject asks for
    # 0.11; an older one kept by another package's pin must not put fake boundaries in shards)
    for text in specials:
        if ordinary_ids(enc, f"a{text}").tolist() != enc.encode_ordinary(f"a{text}"):
            return None, f"tiktoken {tiktoken.__version__} encodes a special's text as the special"
    return enc, None
