"""`codex data shard`: the cleaned corpus -> fixed-size token shards + manifest.json (the commit marker).

    RUN/clean/part-*.parquet (sorted, rows in order)
      --> split per document: blake2b(text) < val_fraction -> val, else train (pinned, never leaks)
      --> encode batches of ~4M chars (tokenizers' encode_batch threads, or --workers processes);
          documents longer than chunk_chars are cut at line/space boundaries first (BPE on one huge
          string is quadratic); each document = <|bos|> + tokens (+ <|eos|>)
      --> per split, a stream of tokens cut into shards of exactly shard_tokens (the last may be short)
          train_00000.npy, ..., val_00000.npy (+ .parquet with --format parquet|both)
      --> manifest.json last

Determinism: the output depends only on the clean files, the tokenizer and the shard settings, never
on --workers (documents are encoded in batches and put back in corpus order), so 1 or N workers and
any rerun give byte-identical shards.

Resume: after each shard is written (atomically) its entry and the corpus position where the next
shard of its split starts (document index within the split, token offset inside that document) go
into shard_progress.json. A rerun re-checks the sha256 of every recorded shard, keeps the good
prefix of each split, and encodes only documents from there on; documents before it are just read
and hashed (cheap). The manifest is written only when every split is complete.

Memory: one shard buffer per split (shard_tokens x 2 or 4 bytes) plus a few batches in flight,
whatever the corpus size.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import itertools
import logging
import math
import multiprocessing as mp
import os
import re
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from codex import fsio, rundir
from codex.config import Config, ConfigError, save_config
from codex.progress import Progress

log = logging.getLogger("codex.shard")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "shard_progress.json"   # resume state; kept after the manifest so a damaged shard can be redone
SPLITS = ("train", "val")
BATCH_CHARS = 4_000_000           # text per encode task: big enough for the thread pool, small for memory
READ_ROWS = 2048                  # parquet rows decoded at a time
PARQUET_ROW_GROUP = 1 << 20       # tokens per row group in parquet shards
RETRIES = 5                       # attempts for a remote write hitting a transient error


class ShardError(ConfigError):
    """Bad input for `codex data shard` (missing tokenizer or corpus, impossible settings). Exit 2."""


# --- the train/val split ---------------------------------------------------------------------------

def split_value(text: str) -> float:
    """Where a document falls in [0, 1): the first 8 bytes of its BLAKE2b hash. val if < val_fraction.

    A function of the text alone, so the split is the same on every rerun and machine, and exact
    duplicates always land in the same split (no train/val leak through copies).
    """
    h = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def _suggest_fraction(min_value: float) -> str:
    """The smallest 2-significant-digit fraction that puts at least one document into val."""
    if min_value <= 0:
        return "1e-6"
    digits = -math.floor(math.log10(min_value)) + 1
    v = math.ceil(min_value * 10**digits * 1.0000001) / 10**digits
    if v <= min_value:
        v += 10**-digits
    return f"{v:.{digits}f}".rstrip("0").rstrip(".")


# --- long documents ---------------------------------------------------------------------------------

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


# --- encoding (runs in this process or in worker processes) ----------------------------------------

@dataclass
class _Encoder:
    tokenizer_json: str
    bos: int
    eos: int
    append_eos: bool
    dtype: str
    chunk_chars: int

    def load(self):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(self.tokenizer_json)
        tok.encode_special_tokens = True  # a literal "<|bos|>" in a document is text, not a boundary
        return tok

    def encode(self, tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat token ids of all documents, tokens per document), each document with its specials."""
        pieces, first, last = [], [], []
        for text in texts:
            parts = split_long_text(text, self.chunk_chars)
            first += [True] + [False] * (len(parts) - 1)
            last += [False] * (len(parts) - 1) + [True]
            pieces += parts
        # add_special_tokens=False: the documents' specials are ours to place, not a post-processor's
        encodings = tok.encode_batch_fast(pieces, add_special_tokens=False)
        bos, eos = (self.bos,), (self.eos,)
        seqs, doc_starts = [], []
        for enc, is_first, is_last in zip(encodings, first, last):
            if is_first:
                doc_starts.append(len(seqs))
                seqs.append(bos)
            seqs.append(enc.ids)
            if is_last and self.append_eos:
                seqs.append(eos)
        lengths = np.fromiter(map(len, seqs), np.int64, len(seqs))
        flat = np.fromiter(itertools.chain.from_iterable(seqs), self.dtype, int(lengths.sum()))
        per_doc = np.add.reduceat(lengths, doc_starts) if doc_starts else np.zeros(0, np.int64)
        return flat, per_doc


_worker_state: dict = {}


def _worker_init(encoder: _Encoder, threads: int) -> None:
    # Read by rayon when tokenizers first builds its thread pool: N processes x `threads` threads
    # should not oversubscribe the cores.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    _worker_state["encoder"] = encoder
    _worker_state["tok"] = encoder.load()


def _worker_encode(texts: list[str]):
    return _worker_state["encoder"].encode(_worker_state["tok"], texts)


# --- inputs --------------------------------------------------------------------------------------

def clean_files(clean: str) -> list[str]:
    from pipeline.clean import finished_files

    return finished_files(clean)


def _inputs_fingerprint(files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.rsplit('/', 1)[-1]}\t{fsio.size(f)}\n".encode())
    return h.hexdigest()


def read_text_batches(files: list[str]):
    """Yield lists of document texts in corpus order (files sorted, rows in order)."""
    for path in files:
        with fsio.open(path, "rb") as fh:
            try:
                pf = pq.ParquetFile(fh)
            except Exception as e:
                raise ShardError(f"{path}: not a readable parquet file ({e})") from None
            if "text" not in pf.schema_arrow.names:
                raise ShardError(f"{path}: no 'text' column (has {pf.schema_arrow.names})")
            row = 0
            for batch in pf.iter_batches(batch_size=READ_ROWS, columns=["text"]):
                col = batch.column(0)
                if col.null_count:
                    bad = row + next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
                    raise ShardError(f"{path}: row {bad}: text is null")
                yield col.to_pylist()
                row += len(col)


# --- shard files ---------------------------------------------------------------------------------

SHARD_NAME = re.compile(r"(train|val)_\d{5,}\.(npy|parquet)")


def shard_name(split: str, index: int, fmt: str) -> str:
    return f"{split}_{index:05d}.{fmt}"


class _HashingWriter:
    """File-like that hashes what passes through (np.save writes in chunks, no full copy)."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.n += len(b)
        return self.f.write(b)


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    code = getattr(e, "code", None) or getattr(e, "status", None)
    if isinstance(code, int):
        return code == 429 or code == 408 or code >= 500
    return type(e).__module__.startswith(("aiohttp", "requests", "urllib3"))


def with_retries(fn, what: str, attempts: int = RETRIES):
    """fn() with exponential backoff on transient (network/5xx/429) errors; anything else raises."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:
            if i == attempts - 1 or not _is_transient(e):
                raise
            wait = min(2.0**i, 30.0)
            log.warning("%s: transient error (%s: %s); retry %d/%d in %.0fs", what, type(e).__name__, e,
                        i + 1, attempts - 1, wait)
            time.sleep(wait)


def write_npy(path: str, tokens: np.ndarray) -> tuple[str, int]:
    """Write tokens as .npy atomically; returns (sha256 of the file bytes, size)."""
    def attempt():
        with fsio.atomic_open(path, "wb") as f:
            w = _HashingWriter(f)
            np.lib.format.write_array(w, tokens, version=(1, 0), allow_pickle=False)
        return w.sha.hexdigest(), w.n
    return with_retries(attempt, path)


def write_parquet(path: str, tokens: np.ndarray) -> tuple[str, int]:
    """One column `tokens`, one row per token (zstd). Bytes are deterministic for a pyarrow version."""
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"tokens": pa.array(tokens)}), sink, compression="zstd",
                   row_group_size=PARQUET_ROW_GROUP, write_statistics=False)
    data = sink.getvalue().to_pybytes()

    def attempt():
        fsio.write_bytes(path, data)
        return hashlib.sha256(data).hexdigest(), len(data)
    return with_retries(attempt, path)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with fsio.open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


# --- the per-split shard writer --------------------------------------------------------------------

@dataclass
class _SplitWriter:
    """Cuts one split's token stream into shards of exactly shard_tokens and commits each one."""

    split: str
    out: str
    shard_tokens: int
    dtype: str
    formats: list[str]
    commit: object                    # callback(split, entries, cursor) after a shard's files exist
    index: int = 0                    # next shard number
    cursor: dict = field(default_factory=lambda: {"doc": 0, "offset": 0})
    fill: int = 0
    docs: int = 0
    buf: np.ndarray | None = None

    def add(self, flat: np.ndarray, per_doc: np.ndarray, first_doc: int, first_offset: int) -> None:
        """Append documents first_doc, first_doc+1, ... (the first one starting at token first_offset)."""
        if self.buf is None:
            self.buf = np.empty(self.shard_tokens, self.dtype)
        starts = np.concatenate([[0], np.cumsum(per_doc)[:-1]]).astype(np.int64)
        pos = 0
        while pos < len(flat):
            take = min(self.shard_tokens - self.fill, len(flat) - pos)
            self.buf[self.fill:self.fill + take] = flat[pos:pos + take]
            # documents whose <|bos|> lies in [pos, pos + take); a resumed first document has none
            lo, hi = np.searchsorted(starts, [pos, pos + take], side="left")
            self.docs += int(hi - lo) - (1 if lo == 0 < hi and first_offset > 0 else 0)
            self.fill += take
            pos += take
            if self.fill == self.shard_tokens:
                if pos == len(flat):
                    nxt = {"doc": first_doc + len(per_doc), "offset": 0}
                else:
                    j = int(np.searchsorted(starts, pos, side="right")) - 1
                    nxt = {"doc": first_doc + j, "offset": int(pos - starts[j]) + (first_offset if j == 0 else 0)}
                self._write(nxt)

    def finish(self, end_doc: int) -> None:
        if self.fill:
            self._write({"doc": end_doc, "offset": 0})

    def _write(self, nxt: dict) -> None:
        tokens = self.buf[:self.fill]
        entries = []
        for fmt in self.formats:
            name = shard_name(self.split, self.index, fmt)
            writer = write_npy if fmt == "npy" else write_parquet
            sha, _ = writer(fsio.join(self.out, name), tokens)
            entries.append({"split": self.split, "path": name, "format": fmt, "tokens": int(self.fill),
                            "documents": int(self.docs), "sha256": sha})
        self.cursor = nxt
        self.commit(self.split, entries, nxt)
        self.index += 1
        self.fill = 0
        self.docs = 0


# --- settings, tokenizer, resume state -------------------------------------------------------------

def _dtype_for(vocab_size: int, requested: str, where: str) -> str:
    fits16 = vocab_size <= 2**16
    if requested == "auto":
        return "uint16" if fits16 else "uint32"
    if requested == "uint16" and not fits16:
        raise ShardError(f"data.shard.dtype=uint16 cannot hold vocab_size {vocab_size} of {where} "
                         f"(uint16 holds ids < 65536): use dtype=uint32 or auto")
    return requested


def _validate(cfg: Config) -> None:
    s = cfg.data.shard
    if s.shard_tokens < 2:
        raise ShardError(f"data.shard.shard_tokens must be >= 2 (a window needs 2 tokens), got {s.shard_tokens}")
    if not 0 < s.val_fraction < 1:
        raise ShardError(f"data.shard.val_fraction must be in (0, 1), got {s.val_fraction}")
    if s.workers < 1:
        raise ShardError(f"data.shard.workers must be >= 1, got {s.workers}")
    if s.chunk_chars < 1000:
        raise ShardError(f"data.shard.chunk_chars must be >= 1000, got {s.chunk_chars}")


def _load_tokenizer(tok_dir: str):
    from pipeline.tokenizer import load_meta, load_tokenizer

    if not fsio.exists(fsio.join(tok_dir, "tokenizer.json")):
        raise ShardError(f"no tokenizer: {tok_dir}/tokenizer.json not found (run `codex data tokenize` first)")
    try:
        meta = load_meta(tok_dir)
        tok = load_tokenizer(tok_dir)
    except FileNotFoundError as e:
        raise ShardError(str(e)) from None
    except ValueError as e:  # sha256 / vocab mismatch between tokenizer.json and its meta
        raise ShardError(str(e)) from None
    ids = meta["special_ids"]
    for name in ("bos", "eos"):
        token = f"<|{name}|>"
        if tok.token_to_id(token) != ids[name]:
            raise ShardError(f"{tok_dir}: {token} has id {tok.token_to_id(token)} but tokenizer_meta.json says {ids[name]}")
    return tok, meta


def _settings(cfg: Config, meta: dict, dtype: str, inputs_sha: str) -> dict:
    """Everything the shard bytes depend on: a rerun with other settings must not mix outputs."""
    s = cfg.data.shard
    return {"format_version": FORMAT_VERSION, "tokenizer_sha256": meta["sha256"], "vocab_size": meta["vocab_size"],
            "dtype": dtype, "shard_tokens": s.shard_tokens, "val_fraction": s.val_fraction,
            "append_eos": s.append_eos, "format": s.format, "chunk_chars": s.chunk_chars,
            "inputs_sha256": inputs_sha}


def _mismatch(old: dict, new: dict) -> list[str]:
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in new if old.get(k) != new.get(k)]


def _good_prefix(out: str, entries: list[dict]) -> int:
    """How many recorded shards (groups of entries with one index) still match their sha256."""
    good = 0
    for group in entries:
        for e in group["files"]:
            try:   # the progress file is read back like a manifest: its paths stay inside `out`
                p = fsio.join_inside(out, e["path"], f"{fsio.join(out, PROGRESS)}: a shard path")
            except ValueError as err:
                log.warning("shard: %s; redoing it and the rest of its split", err)
                return good
            if not fsio.exists(p) or file_sha256(p) != e["sha256"]:
                log.warning("shard: %s is missing or changed; redoing it and the rest of its split", p)
                return good
        good += 1
    return good


def _remove_temp_files(out: str) -> None:
    """Temp files of a killed write (never under a final name): remove them."""
    for p in fsio.listdir(out):
        name = fsio.basename(p)
        if name.startswith(".tmp-") or re.search(r"\.tmp-[0-9a-f]{8}$", name):
            fsio.rm(p)


def scan_corpus(files: list[str], val_fraction: float) -> dict:
    """Count documents per split before any encoding, so an impossible split fails in seconds, not
    after hours of tokenization. Reading + hashing is ~100x cheaper than encoding."""
    docs = {sp: 0 for sp in SPLITS}
    min_value, n_bytes = 1.0, 0
    with Progress("shard scan", unit="docs") as prog:
        for texts in read_text_batches(files):
            for text in texts:
                v = split_value(text)
                min_value = min(min_value, v)
                docs["val" if v < val_fraction else "train"] += 1
            prog.update(len(texts))
    n = sum(docs.values())
    if n == 0:
        raise ShardError(f"empty corpus: the {len(files)} cleaned parquet file(s) hold no documents")
    if docs["val"] == 0:
        raise ShardError(f"val_fraction={val_fraction} puts none of the {n} documents into validation: "
                         f"use --val-fraction {_suggest_fraction(min_value)} or larger")
    if docs["train"] == 0:
        raise ShardError(f"val_fraction={val_fraction} puts all {n} documents into validation: lower it")
    return docs


# --- the stage -----------------------------------------------------------------------------------

def run_shard(cfg: Config) -> dict:
    """Tokenize RUN/clean into shards under cfg.data.shard.out (default RUN/shards); returns the manifest."""
    s = cfg.data.shard
    _validate(cfg)
    out = s.out or rundir.shards_dir(cfg.run)
    tok_dir = rundir.tokenizer_dir(cfg.run)
    tok, meta = _load_tokenizer(tok_dir)
    dtype = _dtype_for(meta["vocab_size"], s.dtype, tok_dir)
    files = clean_files(rundir.clean_dir(cfg.run))
    settings = _settings(cfg, meta, dtype, _inputs_fingerprint(files))
    formats = ["npy", "parquet"] if s.format == "both" else [s.format]

    # An existing manifest or progress file must come from the same settings: never mix two runs.
    manifest_path, progress_path = fsio.join(out, MANIFEST), fsio.join(out, PROGRESS)
    state = existing_state(out)
    if state is not None:
        diff = _mismatch(state["settings"], settings)
        if diff:
            what = "another tokenizer" if any(d.startswith("tokenizer_sha256") for d in diff) else "other settings"
            raise ShardError(f"{out} holds shards made with {what} ({'; '.join(diff)}); "
                             f"remove {out} or pass another --out")
    state = state if state and "splits" in state else {"settings": settings,
                                                      "splits": {sp: [] for sp in SPLITS}}

    # Keep the good prefix of each split; a damaged shard and everything after it are redone.
    resume = {}
    for sp in SPLITS:
        groups = state["splits"][sp]
        good = _good_prefix(out, groups)
        state["splits"][sp] = groups[:good]
        resume[sp] = dict(groups[good - 1]["next"]) if good else {"doc": 0, "offset": 0}
    complete = state.get("complete", {})
    if fsio.exists(manifest_path) and all(complete.get(sp) == len(state["splits"][sp]) for sp in SPLITS):
        log.info("shard: %s is complete and every shard matches its sha256; nothing to do", out)
        return fsio.read_json(manifest_path)
    docs = scan_corpus(files, s.val_fraction)   # fails fast on an empty corpus or an empty val split
    fsio.rm(manifest_path)  # un-commit: a damaged or unfinished output has no manifest
    state["complete"] = {}
    fsio.makedirs(out)
    _remove_temp_files(out)

    def commit(split: str, entries: list[dict], nxt: dict) -> None:
        state["splits"][split].append({"index": len(state["splits"][split]), "files": entries, "next": nxt})
        with_retries(lambda: fsio.write_json(progress_path, state), progress_path)

    fsio.write_json(progress_path, state)
    writers = {sp: _SplitWriter(sp, out, s.shard_tokens, dtype, formats, commit, index=len(state["splits"][sp]),
                                cursor=resume[sp]) for sp in SPLITS}
    encoder = _Encoder(tok.to_str(), meta["special_ids"]["bos"], meta["special_ids"]["eos"], s.append_eos, dtype,
                       s.chunk_chars)
    _encode_corpus(files, encoder, tok, writers, resume, s.val_fraction, s.workers, docs)
    for sp in SPLITS:
        writers[sp].finish(docs[sp])

    manifest = _manifest(state, meta, dtype, s, docs)
    save_config(cfg, fsio.join(out, "config.yaml"))
    state["complete"] = {sp: len(state["splits"][sp]) for sp in SPLITS}
    fsio.write_json(progress_path, state)
    with_retries(lambda: fsio.write_json(manifest_path, manifest), manifest_path)   # last: the commit marker
    t = manifest["totals"]
    log.info("shard: train %d tokens / %d docs / %d shards, val %d tokens / %d docs / %d shards -> %s",
             t["train"]["tokens"], t["train"]["documents"], t["train"]["shards"],
             t["val"]["tokens"], t["val"]["documents"], t["val"]["shards"], out)
    return manifest


def existing_state(out: str) -> dict | None:
    """What an output folder already holds: the progress file (resume state), else {"settings"} of
    the manifest, else None."""
    progress_path, manifest_path = fsio.join(out, PROGRESS), fsio.join(out, MANIFEST)
    if fsio.exists(progress_path):
        return fsio.read_json(progress_path)
    if fsio.exists(manifest_path):
        return {"settings": fsio.read_json(manifest_path).get("settings", {})}
    return None


def _manifest(state: dict, meta: dict, dtype: str, s, docs: dict) -> dict:
    shards, totals = [], {}
    for sp in SPLITS:
        groups = state["splits"][sp]
        for g in groups:
            shards += g["files"]
        first = [g["files"][0] for g in groups]
        totals[sp] = {"tokens": sum(e["tokens"] for e in first), "documents": sum(e["documents"] for e in first),
                      "shards": len(groups)}
        if totals[sp]["documents"] != docs[sp]:  # each document's <|bos|> sits in exactly one shard
            raise RuntimeError(f"shard: {sp} shards hold {totals[sp]['documents']} documents, corpus has "
                               f"{docs[sp]}: internal error, please report")
    return {"format_version": FORMAT_VERSION,
            "tokenizer": {"sha256": meta["sha256"], "vocab_size": meta["vocab_size"]},
            "special_ids": dict(meta["special_ids"]),
            "dtype": dtype, "append_eos": s.append_eos, "val_fraction": s.val_fraction,
            "shard_tokens": s.shard_tokens, "shards": shards, "totals": totals,
            "settings": state["settings"]}


def _encode_corpus(files, encoder: _Encoder, tok, writers: dict, resume: dict, val_fraction: float,
                   workers: int, docs: dict) -> None:
    """Stream the corpus through the encoder into the split writers, in corpus order."""
    doc_count = {sp: 0 for sp in SPLITS}
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        pool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                      initargs=(encoder, threads))
        submit = lambda texts: pool.submit(_worker_encode, texts)  # noqa: E731
        max_in_flight = 2 * workers
    else:
        # One encode thread (tokenizers releases the GIL and uses its own thread pool), so reading,
        # hashing and writing overlap with encoding.
        pool = cf.ThreadPoolExecutor(1)
        submit = lambda texts: pool.submit(encoder.encode, tok, texts)  # noqa: E731
        max_in_flight = 2
    in_flight: collections.deque = collections.deque()

    def drain(limit: int) -> None:
        while len(in_flight) > limit:
            fut, plan, n_bytes = in_flight.popleft()
            flat, per_doc = fut.result()
            _route(flat, per_doc, plan, writers)
            prog.update(len(plan), tokens=len(flat), bytes=n_bytes)

    batch, plan, chars = [], [], 0
    todo = sum(docs[sp] - resume[sp]["doc"] for sp in SPLITS)   # a resumed run skips finished documents
    with Progress("shard", total=todo, unit="docs") as prog:
        try:
            for texts in read_text_batches(files):
                for text in texts:
                    sp = "val" if split_value(text) < val_fraction else "train"
                    i = doc_count[sp]
                    doc_count[sp] += 1
                    r = resume[sp]
                    if i < r["doc"]:
                        continue   # already in a finished shard
                    batch.append(text)
                    plan.append((sp, i, r["offset"] if i == r["doc"] else 0))
                    chars += len(text)
                    if chars >= BATCH_CHARS:
                        in_flight.append((submit(batch), plan, sum(len(t.encode("utf-8")) for t in batch)))
                        batch, plan, chars = [], [], 0
                        drain(max_in_flight)
            if batch:
                in_flight.append((submit(batch), plan, sum(len(t.encode("utf-8")) for t in batch)))
            drain(0)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    if doc_count != docs:
        raise RuntimeError(f"shard: the corpus changed while it was read ({docs} documents, then {doc_count})")


def _route(flat: np.ndarray, per_doc: np.ndarray, plan: list, writers: dict) -> None:
    """Hand each split its documents from one encoded batch (in order), dropping resumed prefixes."""
    splits = np.array([p[0] == "val" for p in plan])
    for sp, is_val in (("train", False), ("val", True)):
        sel = np.flatnonzero(splits == is_val)
        if len(sel) == 0:
            continue
        if len(sel) == len(plan):
            f, lens = flat, per_doc
        else:
            mask = np.repeat(splits == is_val, per_doc)
            f, lens = flat[mask], per_doc[sel]
        first_doc, skip = plan[sel[0]][1], plan[sel[0]][2]
        if skip:  # resumed inside this document: its first `skip` tokens are in a finished shard
            f = f[skip:]
            lens = lens.copy()
            lens[0] -= skip
        writers[sp].add(f, lens, first_doc, skip)


# --- verify ----------------------------------------------------------------------------------------

class _HashingReader:
    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        b = self.f.read(n)
        self.sha.update(b)
        self.n += len(b)
        return b


def _check_npy(path: str, entry: dict, dtype: str, vocab: int, bos: int) -> tuple[list[str], int | None]:
    """Stream one .npy shard: sha256, header, token count, ids < vocab, <|bos|> count. (problems, first token)."""
    problems, first = [], None
    with fsio.open(path, "rb") as f:
        r = _HashingReader(f)
        try:
            version = np.lib.format.read_magic(r)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dt = read_header(r)
        except Exception as e:
            return [f"{path}: not a valid .npy file ({e})"], None
        if str(dt) != dtype or len(shape) != 1:
            problems.append(f"{path}: holds {dt} {shape}, manifest says {dtype} [{entry['tokens']}]")
        n = bos_count = 0
        top = -1
        step = (8 << 20) // dt.itemsize * dt.itemsize
        while chunk := r.read(step):
            a = np.frombuffer(chunk[: len(chunk) // dt.itemsize * dt.itemsize], dt)
            if first is None and len(a):
                first = int(a[0])
            n += len(a)
            bos_count += int(np.count_nonzero(a == bos))
            top = max(top, int(a.max()) if len(a) else -1)
    if r.sha.hexdigest() != entry["sha256"]:
        problems.append(f"{path}: sha256 {r.sha.hexdigest()[:12]} != manifest {entry['sha256'][:12]} (corrupt or changed)")
    if shape and n != shape[0]:
        problems.append(f"{path}: {n} tokens on disk, header says {shape[0]} (truncated)")
    if n != entry["tokens"]:
        problems.append(f"{path}: {n} tokens, manifest says {entry['tokens']}")
    if bos_count != entry["documents"]:
        problems.append(f"{path}: {bos_count} documents (<|bos|>), manifest says {entry['documents']}")
    if top >= vocab:
        problems.append(f"{path}: token id {top} >= vocab_size {vocab}")
    return problems, first


def _check_parquet(path: str, entry: dict, vocab: int, bos: int) -> tuple[list[str], int | None]:
    sha = file_sha256(path)
    problems = [] if sha == entry["sha256"] else [
        f"{path}: sha256 {sha[:12]} != manifest {entry['sha256'][:12]} (corrupt or changed)"]
    if problems:
        return problems, None
    with fsio.open(path, "rb") as f:
        a = pq.read_table(f, columns=["tokens"]).column(0).to_numpy()
    if len(a) != entry["tokens"]:
        problems.append(f"{path}: {len(a)} tokens, manifest says {entry['tokens']}")
    if int(np.count_nonzero(a == bos)) != entry["documents"]:
        problems.append(f"{path}: {int(np.count_nonzero(a == bos))} documents, manifest says {entry['documents']}")
    if len(a) and int(a.max()) >= vocab:
        problems.append(f"{path}: token id {int(a.max())} >= vocab_size {vocab}")
    return problems, int(a[0]) if len(a) else None


def _entry_path(shards_dir: str, manifest_path: str, i: int, e) -> tuple[str, str | None]:
    """(the shard's path, None), or ("", a problem) when manifest entry i lacks a key or its path
    leaves the shards folder."""
    missing = [k for k in ("split", "path", "format", "tokens", "documents", "sha256")
               if not isinstance(e, dict) or k not in e]
    if missing:
        return "", f"{manifest_path}: shards[{i}] has no {', '.join(repr(k) for k in missing)}"
    try:
        return fsio.join_inside(shards_dir, e["path"], f"{manifest_path}: shards[{i}].path"), None
    except ValueError as err:
        return "", str(err)


def verify_shards(shards_dir: str, tokenizer_dir: str | None = None) -> list[str]:
    """Check every shard against manifest.json (sha256, dtype, tokens, documents, ids < vocab, totals);
    with tokenizer_dir, also that it is the tokenizer the manifest names. [] when all is well."""
    manifest_path = fsio.join(shards_dir, MANIFEST)
    if not fsio.exists(manifest_path):
        if not fsio.isdir(shards_dir) or not fsio.listdir(shards_dir):
            return [f"{shards_dir}: no shards here (run `codex data shard` first, or check the run directory)"]
        return [f"{manifest_path} not found: the shard run never finished (rerun `codex data shard`)"]
    try:
        m = fsio.read_json(manifest_path)
        dtype, vocab, bos = m["dtype"], m["tokenizer"]["vocab_size"], m["special_ids"]["bos"]
        shards, totals = m["shards"], m["totals"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{manifest_path}: unreadable manifest ({e})"]
    problems = []
    if m.get("format_version") != FORMAT_VERSION:
        problems.append(f"{manifest_path}: format_version {m.get('format_version')}, this codex reads {FORMAT_VERSION}")
    if tokenizer_dir and fsio.exists(fsio.join(tokenizer_dir, "tokenizer.json")):
        sha = file_sha256(fsio.join(tokenizer_dir, "tokenizer.json"))
        if sha != m["tokenizer"]["sha256"]:
            problems.append(f"{tokenizer_dir}/tokenizer.json has sha256 {sha[:12]}, the shards were made with "
                            f"{m['tokenizer']['sha256'][:12]}")
    seen = {sp: {} for sp in SPLITS}
    for i, e in enumerate(shards):
        path, problem = _entry_path(shards_dir, manifest_path, i, e)
        if problem:
            problems.append(problem)
            continue
        if not fsio.exists(path):
            problems.append(f"{path}: missing")
            continue
        if e["format"] == "npy":
            found, first = _check_npy(path, e, dtype, vocab, bos)
        else:
            found, first = _check_parquet(path, e, vocab, bos)
        problems += found
        split_seen = seen.setdefault(e["split"], {})
        if e["format"] not in split_seen:
            split_seen[e["format"]] = {"tokens": 0, "documents": 0, "shards": 0}
            if not found and first != bos:
                problems.append(f"{path}: the first shard of {e['split']} does not start with <|bos|>")
        t = split_seen[e["format"]]
        t["tokens"] += e["tokens"]
        t["documents"] += e["documents"]
        t["shards"] += 1
    for sp, by_format in seen.items():
        for fmt, t in by_format.items():
            if t != totals.get(sp):
                problems.append(f"{manifest_path}: {sp} {fmt} shards add up to {t}, totals say {totals.get(sp)}")
    # Shard-named files the manifest does not list: the loader ignores them, but a copy of this
    # folder would carry them and a reader could take them for data, so say so.
    listed = {e["path"] for e in shards}
    for path in fsio.listdir(shards_dir):
        name = fsio.basename(path)
        if SHARD_NAME.fullmatch(name) and name not in listed:
            problems.append(f"{path}: a shard file that {MANIFEST} does not list (left from another run?); "
                            f"delete it")
    return problems
