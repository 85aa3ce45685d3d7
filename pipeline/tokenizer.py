"""`codex data tokenize`: train a byte-level BPE tokenizer on the cleaned corpus.

    RUN/clean/part-*.parquet (or data.tokenizer.inputs)
      -> pass 1: hash every document, keep the smallest hashes up to max_chars (and the largest
                 `heldout_docs` hashes aside to measure compression)
      -> pass 2: re-read, feed the selected documents to the HF `tokenizers` BPE trainer one at a time
      -> RUN/tokenizer/ tokenizer.json, token_bytes.npy, config.yaml, tokenizer_meta.json (last)

The tokenizer (see ARCHITECTURE.md, "Tokenizer contract"):
- byte-level BPE: the 256 byte symbols are always in the vocabulary, so every string encodes and
  there is no unknown token; no normalizer, so decode(encode(x)) == x for every string x;
- specials take the first ids: <|bos|> = 0, <|eos|> = 1, <|pad|> = 2;
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
import os
import posixpath
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

def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer with codex's split regex and no normalizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        # use_regex=False: the split above replaces ByteLevel's GPT-2 regex; this only maps bytes.
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts, vocab_size: int, length: int | None = None) -> Tokenizer:
    """Train on an iterator of strings (or of lists of strings); specials get ids 0..2, then the 256 bytes."""
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


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype holding ids 0..vocab_size-1 (vocab 65,536 still fits uint16)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 bytes->unicode map used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


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
        # Clean writes stats.json (listing its shards) only once every task has finished: reading
        # its list, not a glob, never trains on a half-cleaned corpus or a crashed chunk's leftovers.
        clean = rundir.clean_dir(cfg.run)
        stats_path = fsio.join(clean, "stats.json")
        if not fsio.exists(stats_path):
            partial = bool(fsio.glob(fsio.join(clean, "part-*.parquet")))
            raise FileNotFoundError(
                f"{stats_path} not found: " + ("`codex data clean` has not finished (tasks still running or killed); "
                                               "finish it first" if partial else
                                               f"run `codex data clean --run {cfg.run}` first") + " or pass --input")
        shards = fsio.read_json(stats_path).get("shards")
        if not isinstance(shards, list) or not shards:
            raise ValueError(f"{stats_path}: no 'shards' list: nothing to train on")
        return sorted(fsio.join(clean, name) for name in shards)
    files: list[str] = []
    for spec in inputs:
        if any(ch in spec for ch in "*?["):
            found = [f for f in fsio.glob(spec) if f.endswith(SUFFIXES)]
        elif fsio.isdir(spec):
            found = [f for f in fsio.listdir(spec)
                     if f.endswith(SUFFIXES) and not posixpath.basename(f.replace(os.sep, "/")).startswith(".")]
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
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest(), "big")


# --- pass 1: which documents --------------------------------------------------------------------

@dataclass
class Selection:
    """What pass 1 decided. `train`/`heldout` map file index -> sorted row indices."""
    train: dict[int, list[int]] = field(default_factory=dict)
    heldout: dict[int, list[int]] = field(default_factory=dict)
    train_docs: int = 0
    train_chars: int = 0
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
        self.heap: list[tuple[int, int, int, int]] = []  # (-hash, chars, file, row)
        self.chars = 0
        self.ceiling: int | None = None

    def offer(self, h: int, chars: int, file: int, row: int) -> None:
        if self.ceiling is not None and h >= self.ceiling:
            return
        heapq.heappush(self.heap, (-h, chars, file, row))
        self.chars += chars
        while self.chars > self.budget:
            neg, c, _, _ = heapq.heappop(self.heap)
            self.chars -= c
            self.ceiling = -neg

    def kept(self) -> list[tuple[int, int, int, int]]:
        """(hash, chars, file, row) in hash order."""
        return sorted((-neg, c, f, r) for neg, c, f, r in self.heap)


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
                        h = doc_hash(text)
                    except UnicodeEncodeError as e:
                        raise ValueError(f"{path}: row {r}: text is not valid Unicode ({e.reason} at {e.start})") from None
                    chars = min(len(text), doc_max_chars)
                    sel.docs_capped += len(text) > doc_max_chars
                    sel.docs_seen += 1
                    sel.chars_seen += chars
                    nchars += len(text)
                    budget.offer(h, chars, fi, r)
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
    for h, chars, fi, r in budget.kept():
        if h in held_hashes:  # also drops exact duplicates of a held-out document
            continue
        sel.train.setdefault(fi, []).append(r)
        sel.train_docs += 1
        sel.train_chars += chars
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
            "heldout_docs": t.heldout_docs, "split_pattern": SPLIT_PATTERN, "format_version": FORMAT_VERSION}


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

    log.info("tokenize: %d input files, vocab %d, budget %d chars", len(files), t.vocab_size, t.max_chars)
    sel = select_documents(files, t.max_chars, t.doc_max_chars, t.heldout_docs)
    if sel.train_docs == 0:
        raise ValueError(f"no training text: {sel.docs_seen} non-empty documents in {len(files)} files "
                         f"and none fits data.tokenizer.max_chars={t.max_chars}")
    log.info("tokenize: training on %d of %d documents (%d chars, %d capped at %d chars), %d held out",
             sel.train_docs, sel.docs_seen, sel.train_chars, sel.docs_capped, t.doc_max_chars, sel.heldout_docs)
    t_scan = time.perf_counter() - t0

    heldout: list[str] = []
    tok = train_tokenizer(iter_selected(files, sel.train, sel.heldout, t.doc_max_chars, heldout, sel.train_docs),
                          t.vocab_size)
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
            "heldout_docs": sel.heldout_docs,
        },
        "chars_used": sel.train_chars,
        "compression": comp,
        "peak_rss_mb": _peak_rss_mb(),
        "seconds": {"scan": round(t_scan, 2), "train": round(t_train, 2),
                    "total": round(time.perf_counter() - t0, 2)},
        "tokenizers_version": _tokenizers_version(),
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


def _tokenizers_version() -> str:
    import tokenizers

    return tokenizers.__version__


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
