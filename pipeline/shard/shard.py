"""`codex data shard`: the cleaned corpus -> fixed-size token shards + manifest.json (the commit
marker).

    RUN/clean/part-*.parquet (sorted, rows in order)
      --> split per document: blake2b(text) < val_fraction -> val, else train (pinned, never leaks)
      --> encode batches of ~4M chars (tokenizers' encode_batch threads, or --workers processes);
          documents longer than chunk_chars are cut at line/space boundaries first (BPE on one huge
          string is quadratic); each document = <|bos|> + tokens (+ <|eos|>)
      --> per split, a stream of tokens cut into shards of exactly shard_tokens (the last may be
          short)
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

Elsewhere: the encoding (pipeline/encode.py), the folder's file names, manifest and progress file
(pipeline/shard/manifest.py), the checks of `codex data verify` (pipeline/shard/verify.py), when the
stage may skip or overwrite (pipeline/stage.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from codex import fsio, rundir
from codex.config import Config, ConfigError
from codex.progress import Progress
from pipeline.encode import Encoder, encode_in_order, token_dtype
from pipeline.inputs import clean_parts
from pipeline.readers import BadInputFile, iter_text_batches
from pipeline.shard.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    PROGRESS,
    SPLITS,
    build_manifest,
    existing_state,
    good_prefix,
    mismatch,
    remove_temp_files,
    shard_entry,
    shard_name,
)
from pipeline.stage import Stage
from pipeline.tokenizer.tokenizer import load_meta, load_tokenizer

log = logging.getLogger("codex.shard")

BATCH_CHARS = 4_000_000  # text per encode task: big enough for the thread pool, small for memory
READ_ROWS = 2048  # parquet rows decoded at a time
PARQUET_ROW_GROUP = 1 << 20  # tokens per row group in parquet shards


class ShardError(ConfigError):
    """Bad input for `codex data shard` (missing tokenizer or corpus, impossible settings).
    Exit 2."""


# --- the train/val split --------------------------------------------------------------------------


def split_value(text: str) -> float:
    """Where a document falls in [0, 1): the first 8 bytes of its BLAKE2b hash. val if
    < val_fraction.

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


# --- inputs --------------------------------------------------------------------------------------


def _inputs_fingerprint(files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.rsplit('/', 1)[-1]}\t{fsio.size(f)}\n".encode())
    return h.hexdigest()


def read_text_batches(files: list[str]):
    """Yield lists of document texts in corpus order (files sorted, rows in order); a null text or
    an unreadable file is a ShardError naming it."""
    for path in files:
        row = 0
        try:
            for texts in iter_text_batches(path, batch_rows=READ_ROWS):
                if None in texts:
                    raise ShardError(f"{path}: row {row + texts.index(None)}: text is null")
                yield texts
                row += len(texts)
        except BadInputFile as e:
            raise ShardError(str(e)) from None


# --- shard files ---------------------------------------------------------------------------------


def write_npy(path: str, tokens: np.ndarray) -> tuple[str, int]:
    """Write tokens as .npy atomically; returns (sha256 of the file bytes, size)."""

    def attempt():
        with fsio.atomic_open(path, "wb") as f:
            w = fsio.HashingWriter(f)
            np.lib.format.write_array(w, tokens, version=(1, 0), allow_pickle=False)
        return w.sha.hexdigest(), w.n

    return fsio.with_retries(attempt, path)


def write_parquet(path: str, tokens: np.ndarray) -> tuple[str, int]:
    """One column `tokens`, one row per token (zstd). Bytes are deterministic for a pyarrow
    version."""
    sink = pa.BufferOutputStream()
    pq.write_table(
        pa.table({"tokens": pa.array(tokens)}),
        sink,
        compression="zstd",
        row_group_size=PARQUET_ROW_GROUP,
        write_statistics=False,
    )
    data = sink.getvalue().to_pybytes()

    def attempt():
        fsio.write_bytes(path, data)
        return hashlib.sha256(data).hexdigest(), len(data)

    return fsio.with_retries(attempt, path)


# --- the per-split shard writer -------------------------------------------------------------------


@dataclass
class _SplitWriter:
    """Cuts one split's token stream into shards of exactly shard_tokens and commits each one."""

    split: str
    out: str
    shard_tokens: int
    dtype: str
    formats: list[str]
    commit: Callable[[str, list[dict], dict], None]  # after a shard's files exist
    index: int = 0  # next shard number
    cursor: dict = field(default_factory=lambda: {"doc": 0, "offset": 0})
    fill: int = 0
    docs: int = 0
    buf: np.ndarray | None = None

    def add(self, flat: np.ndarray, per_doc: np.ndarray, first_doc: int, first_offset: int) -> None:
        """Append documents first_doc, first_doc+1, ... (the first one starting at token
        first_offset)."""
        if self.buf is None:
            self.buf = np.empty(self.shard_tokens, self.dtype)
        starts = np.concatenate([[0], np.cumsum(per_doc)[:-1]]).astype(np.int64)
        pos = 0
        while pos < len(flat):
            take = min(self.shard_tokens - self.fill, len(flat) - pos)
            self.buf[self.fill : self.fill + take] = flat[pos : pos + take]
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
                    nxt = {
                        "doc": first_doc + j,
                        "offset": int(pos - starts[j]) + (first_offset if j == 0 else 0),
                    }
                self._write(nxt)

    def finish(self, end_doc: int) -> None:
        if self.fill:
            self._write({"doc": end_doc, "offset": 0})

    def _write(self, nxt: dict) -> None:
        assert self.buf is not None  # allocated by add(), which fills it
        tokens = self.buf[: self.fill]
        entries = []
        for fmt in self.formats:
            name = shard_name(self.split, self.index, fmt)
            writer = write_npy if fmt == "npy" else write_parquet
            sha, _ = writer(fsio.join(self.out, name), tokens)
            entries.append(shard_entry(self.split, name, fmt, self.fill, self.docs, sha))
        self.cursor = nxt
        self.commit(self.split, entries, nxt)
        self.index += 1
        self.fill = 0
        self.docs = 0


# --- settings, tokenizer, resume state ------------------------------------------------------------


def _dtype_for(vocab_size: int, requested: str, where: str) -> str:
    """data.shard.dtype checked against the vocabulary; "auto" is encode.token_dtype's choice."""
    if requested == "auto":
        return token_dtype(vocab_size)
    if requested == "uint16" and token_dtype(vocab_size) != "uint16":
        raise ShardError(
            f"data.shard.dtype=uint16 cannot hold vocab_size {vocab_size} of {where} "
            f"(uint16 holds ids < 65536): use dtype=uint32 or auto"
        )
    return requested


def _validate(cfg: Config) -> None:
    s = cfg.data.shard
    if s.shard_tokens < 2:
        raise ShardError(
            f"data.shard.shard_tokens must be >= 2 (a window needs 2 tokens), got {s.shard_tokens}"
        )
    if not 0 < s.val_fraction < 1:
        raise ShardError(f"data.shard.val_fraction must be in (0, 1), got {s.val_fraction}")
    if s.workers < 1:
        raise ShardError(f"data.shard.workers must be >= 1, got {s.workers}")
    if s.chunk_chars < 1000:
        raise ShardError(f"data.shard.chunk_chars must be >= 1000, got {s.chunk_chars}")


def _load_tokenizer(tok_dir: str):
    if not fsio.exists(fsio.join(tok_dir, "tokenizer.json")):
        raise ShardError(
            f"no tokenizer: {tok_dir}/tokenizer.json not found (run `codex data tokenize` first)"
        )
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
            raise ShardError(
                f"{tok_dir}: {token} has id {tok.token_to_id(token)} "
                f"but tokenizer_meta.json says {ids[name]}"
            )
    return tok, meta


def _settings(cfg: Config, meta: dict, dtype: str, inputs_sha: str) -> dict:
    """Everything the shard bytes depend on: a rerun with other settings must not mix outputs."""
    s = cfg.data.shard
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer_sha256": meta["sha256"],
        "vocab_size": meta["vocab_size"],
        "dtype": dtype,
        "shard_tokens": s.shard_tokens,
        "val_fraction": s.val_fraction,
        "append_eos": s.append_eos,
        "format": s.format,
        "chunk_chars": s.chunk_chars,
        "inputs_sha256": inputs_sha,
    }


def scan_corpus(files: list[str], val_fraction: float) -> dict:
    """Count documents per split before any encoding, so an impossible split fails in seconds, not
    after hours of tokenization. Reading + hashing is ~100x cheaper than encoding."""
    docs = {sp: 0 for sp in SPLITS}
    min_value = 1.0
    with Progress("shard scan", unit="docs") as prog:
        for texts in read_text_batches(files):
            for text in texts:
                v = split_value(text)
                min_value = min(min_value, v)
                docs["val" if v < val_fraction else "train"] += 1
            prog.update(len(texts))
    n = sum(docs.values())
    if n == 0:
        raise ShardError(
            f"empty corpus: the {len(files)} cleaned parquet file(s) hold no documents"
        )
    if docs["val"] == 0:
        raise ShardError(
            f"val_fraction={val_fraction} puts none of the {n} documents into validation: "
            f"use --val-fraction {_suggest_fraction(min_value)} or larger"
        )
    if docs["train"] == 0:
        raise ShardError(
            f"val_fraction={val_fraction} puts all {n} documents into validation: lower it"
        )
    return docs


# --- the stage -----------------------------------------------------------------------------------


def run_shard(cfg: Config) -> dict:
    """Tokenize RUN/clean into shards under cfg.data.shard.out (default RUN/shards); returns the
    manifest."""
    s = cfg.data.shard
    _validate(cfg)
    stage = Stage(
        "codex data shard", cfg, s.out or rundir.shards_dir(cfg.run), MANIFEST, error=ShardError
    )
    out = stage.out
    tok_dir = rundir.tokenizer_dir(cfg.run)
    tok, meta = _load_tokenizer(tok_dir)
    dtype = _dtype_for(meta["vocab_size"], s.dtype, tok_dir)
    files = clean_parts(cfg.run)
    settings = _settings(cfg, meta, dtype, _inputs_fingerprint(files))
    formats: list[str] = ["npy", "parquet"] if s.format == "both" else [s.format]
    state, resume = _resume_state(stage, settings)
    progress_path = fsio.join(out, PROGRESS)
    complete = state.get("complete", {})
    if fsio.exists(stage.marker_path) and all(
        complete.get(sp) == len(state["splits"][sp]) for sp in SPLITS
    ):
        log.info("shard: %s is complete and every shard matches its sha256; nothing to do", out)
        return cast(dict, stage.finished())  # the marker exists: checked just above
    docs = scan_corpus(files, s.val_fraction)  # fails fast on an empty corpus or an empty val split
    stage.start()  # a damaged or unfinished output has no manifest
    state["complete"] = {}
    remove_temp_files(out)

    def commit(split: str, entries: list[dict], nxt: dict) -> None:
        state["splits"][split].append(
            {"index": len(state["splits"][split]), "files": entries, "next": nxt}
        )
        fsio.with_retries(lambda: fsio.write_json(progress_path, state), progress_path)

    fsio.write_json(progress_path, state)
    writers = {
        sp: _SplitWriter(
            sp,
            out,
            s.shard_tokens,
            dtype,
            formats,
            commit,
            index=len(state["splits"][sp]),
            cursor=resume[sp],
        )
        for sp in SPLITS
    }
    encoder = Encoder(
        tok.to_str(),
        meta["special_ids"]["bos"],
        meta["special_ids"]["eos"],
        s.append_eos,
        dtype,
        s.chunk_chars,
    )
    _encode_corpus(files, encoder, tok, writers, resume, s.val_fraction, s.workers, docs)
    for sp in SPLITS:
        writers[sp].finish(docs[sp])

    manifest = build_manifest(state, meta, dtype, s, docs)
    state["complete"] = {sp: len(state["splits"][sp]) for sp in SPLITS}
    fsio.write_json(progress_path, state)
    stage.commit(manifest)
    t = manifest["totals"]
    log.info(
        "shard: train %d tokens / %d docs / %d shards, val %d tokens / %d docs / %d shards -> %s",
        t["train"]["tokens"],
        t["train"]["documents"],
        t["train"]["shards"],
        t["val"]["tokens"],
        t["val"]["documents"],
        t["val"]["shards"],
        out,
    )
    return manifest


def _resume_state(stage: Stage, settings: dict) -> tuple[dict, dict]:
    """(progress state, where each split resumes). An existing manifest or progress file must come
    from the same settings (never mix two runs); the good prefix of each split is kept, and a
    damaged shard and everything after it are redone."""
    out = stage.out
    state = existing_state(out)
    if state is not None:
        diff = mismatch(state["settings"], settings)
        if diff:
            what = (
                "another tokenizer"
                if any(d.startswith("tokenizer_sha256") for d in diff)
                else "other settings"
            )
            stage.refuse(
                f"holds shards made with {what} ({'; '.join(diff)})",
                f"remove {out} or pass another --out",
            )
    if not state or "splits" not in state:
        state = {"settings": settings, "splits": {sp: [] for sp in SPLITS}}
    resume = {}
    for sp in SPLITS:
        groups = state["splits"][sp]
        good = good_prefix(out, groups)
        state["splits"][sp] = groups[:good]
        resume[sp] = dict(groups[good - 1]["next"]) if good else {"doc": 0, "offset": 0}
    return state, resume


def _encode_corpus(
    files,
    encoder: Encoder,
    tok,
    writers: dict,
    resume: dict,
    val_fraction: float,
    workers: int,
    docs: dict,
) -> None:
    """Stream the corpus through the encoder into the split writers, in corpus order.

    8 parameters: what run_shard has set up for it (files, encoder, tokenizer, writers, resume
    state, the document counts it fills) and two settings; its one caller."""
    doc_count = {sp: 0 for sp in SPLITS}

    def batches():
        """(texts, plan) of ~BATCH_CHARS each; plan[k] = (split, index in split, tokens to skip)."""
        batch, plan, chars = [], [], 0
        for texts in read_text_batches(files):
            for text in texts:
                sp = "val" if split_value(text) < val_fraction else "train"
                i = doc_count[sp]
                doc_count[sp] += 1
                r = resume[sp]
                if i < r["doc"]:
                    continue  # already in a finished shard
                batch.append(text)
                plan.append((sp, i, r["offset"] if i == r["doc"] else 0))
                chars += len(text)
                if chars >= BATCH_CHARS:
                    yield batch, plan
                    batch, plan, chars = [], [], 0
        if batch:
            yield batch, plan

    # a resumed run skips finished documents
    todo = sum(docs[sp] - resume[sp]["doc"] for sp in SPLITS)
    with Progress("shard", total=todo, unit="docs") as prog:
        for flat, per_doc, plan, n_bytes in encode_in_order(batches(), encoder, tok, workers):
            _route(flat, per_doc, plan, writers)
            prog.update(len(plan), tokens=len(flat), bytes=n_bytes)
    if doc_count != docs:
        raise RuntimeError(
            f"shard: the corpus changed while it was read ({docs} documents, then {doc_count})"
        )


def _route(flat: np.ndarray, per_doc: np.ndarray, plan: list, writers: dict) -> None:
    """Hand each split its documents from one encoded batch (in order), dropping resumed
    prefixes."""
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
