"""`codex data shard`: the cleaned corpus -> fixed-size token shards + manifest.json (the commit
marker).

    RUN/clean/part-*.parquet (sorted, rows in order: the corpus order)
      --> split per document: blake2b(text) < val_fraction -> val, else train (pinned, never leaks)
      --> each document = <|bos|> + tokens (+ <|eos|>); documents longer than chunk_chars are cut
          at line/space boundaries first (BPE on one huge string is quadratic)
      --> per split, the corpus's token stream cut into shards of exactly shard_tokens (the last
          may be short): train_00000.npy, ..., val_00000.npy (+ .parquet with --format
          parquet|both)
      --> manifest.json last

Units. Each phase runs its units through pipeline/executor.py (this process, --workers processes
sharing one pool for the whole stage, or one Ray task each); this process plans, adds up and writes
the manifest:

    scan     a unit reads one part and counts its documents per split, so an empty corpus or an
             empty val split fails in seconds, before any encoding (reading + hashing is ~30x
             cheaper than encoding); it also samples, every BLOCK_ROWS rows and at the end, the
             UTF-8 bytes and val documents before that row. With fewer parts than units wanted
             (a Ray CPU's one, a local worker's UNITS_PER_WORKER: the pool's processes start
             during the scan) a part is scanned in row ranges cut at its row groups, and their
             counts added up (_scan_units, _joined_scans): the same samples, and no core idles
    encode   a unit is rows [start, stop) of one part. With at least UNITS_PER_WORKER x slots
             parts (slots: local workers, or the Ray cluster's CPUs) each part is one unit;
             with fewer (one 20,000-document part, a few parts) the parts are cut at the scan's
             sampled rows into about that many ranges of about equal bytes, the last ones smaller
             and smaller, so that no core idles (_cuts). A unit reads only the row groups holding
             its rows (read_text_rows; a process keeps the last one it decoded for its next unit,
             which usually starts in it), encodes them in batches of ~BATCH_CHARS into its folder
             of .units/ (manifest.py; the folder's name holds the part and rows): per split its
             token stream and tokens per document, then its marker (part, rows, counts). Its
             documents per split must be what the scan counted in those rows
    write    the markers say where each unit's tokens start in each split's stream (units in
             corpus order), so shard k of a split is that stream's tokens [k * shard_tokens,
             (k + 1) * shard_tokens) whoever writes it; a write task takes consecutive shards
             (~WRITE_TASK_TOKENS, fewer when that would leave a slot without UNITS_PER_WORKER
             tasks), reads only the slices of the units' token files they cover, and writes each
             shard's files (atomically), then its marker

Determinism: the shards depend only on the clean files, the tokenizer and the shard settings,
never on --workers, the executor, where the parts were cut or the order in which units finish
(each split's stream is the units' streams in corpus order, and a document is encoded alone,
whatever batch it is in). Threads: with --workers 1 (or one unit left) the units are encoded here on
the encoder's own threads (every core); N local processes share the cores (cores // N threads
each, tiktoken's included: pipeline/encode.py: _threads), a Ray task has one.

Resume: an encode unit first removes what an earlier attempt of it left (its folder of .units/),
so a task Ray retries after its worker died leaves no partial file; temp files of shard writes are
swept before the manifest is written. A rerun skips the units whose marker matches the settings,
part and rows (a rerun with other --workers may cut the parts elsewhere: a range it does not find
is encoded again) and the shards whose marker's sha256 still matches the file. Once the manifest
is written, .units/ is removed; a rerun then re-checks every shard's sha256 and does nothing when
all match, else encodes the corpus again and rewrites only the shards that do not match. An output
folder made with other settings is refused.

Memory: an encode task holds one batch (~BATCH_CHARS of text and its tokens) and its unit's
document lengths, a write task one shard (shard_tokens x 2 or 4 bytes). Disk: until the manifest is
written, .units/ holds a second copy of the corpus's tokens.

Elsewhere: the encoding (pipeline/encode.py), the folder's file names, manifest and settings file
(pipeline/shard/manifest.py), the checks of `codex data verify` (pipeline/shard/verify.py), when
the stage may skip or overwrite (pipeline/stage.py), where units run (pipeline/executor.py).
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import contextlib
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from codex.core import fsio, rundir
from codex.core.config import Config, ConfigError
from codex.core.progress import Progress
from codex.pipeline.encode import Encoder, EncodeWith, token_dtype
from codex.pipeline.executor import (
    Where,
    check_executor,
    cores,
    run_units,
    slots,
    stage_pool,
    where_for,
    worker_id,
)
from codex.pipeline.inputs import clean_parts
from codex.pipeline.readers import (
    BadInputFile,
    forget_row_group,
    iter_text_batches,
    parquet_text_rows,
)
from codex.pipeline.shard.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    PROGRESS,
    SHARD_MARKERS,
    SPLITS,
    UNIT_DONE,
    UNITS,
    build_manifest,
    existing_state,
    file_matches,
    mismatch,
    remove_temp_files,
    shard_entry,
    shard_name,
)
from codex.pipeline.stage import Stage
from codex.pipeline.tokenizer.tokenizer import load_meta, load_tokenizer

log = logging.getLogger("codex.shard")

BATCH_CHARS = 4_000_000  # text per encode call: big enough for the thread pool, small for memory
READ_ROWS = 2048  # parquet rows decoded at a time
# --workers 0: one process per this much cleaned corpus at most, in parquet bytes (the parts' sizes,
# zstd: ~4-5x less than their text for code, ~3x for prose); one process already encodes on every
# core (the encoder's threads), so below it a second process's start costs more than it gains
# (README's stage table)
AUTO_BYTES_PER_WORKER = 4 << 20
# rows between the places where the scan records its running counts: where a part may be cut into
# several encode units
BLOCK_ROWS = 64
# encode units per unit of parallelism (local worker or Ray CPU) when the parts are fewer: the
# parts are then cut into byte-balanced row ranges, so that no core idles while another encodes
# the last big part
UNITS_PER_WORKER = 4
# the last `slots` of those units are cut in pieces that halve this many times (_cuts): a slot that
# finishes early takes the next, smaller one, and the slots finish within a small piece of each
# other (a unit costs a few ms beyond its encoding: its process keeps the row group it read last)
TAIL_HALVINGS = 3
PARQUET_ROW_GROUP = 1 << 20  # tokens per row group in parquet shards
# tokens per write task (whole shards, at least one): small shards are grouped so that a task is
# worth scheduling, but never so many that a slot has no task (_write_phase)
WRITE_TASK_TOKENS = 64 << 20


class ShardError(ConfigError):
    """A command line `codex data shard` cannot run (missing tokenizer or corpus, impossible
    settings, an output of other settings). Exit 2."""


class ShardDataError(ValueError):
    """Damaged input for `codex data shard` (a cleaned part that cannot be read, a tokenizer.json
    that does not match its meta). Exit 1, like every stage's bad data."""


# --- the train/val split --------------------------------------------------------------------------


def split_value(text: str) -> float:
    """Where a document falls in [0, 1): the first 8 bytes of its BLAKE2b hash. val if
    < val_fraction.

    A function of the text alone, so the split is the same on every rerun and machine, and exact
    duplicates always land in the same split (no train/val leak through copies).
    """
    return _split_value(text.encode("utf-8"))


def _split_value(data: bytes) -> float:
    h = hashlib.blake2b(data, digest_size=8).digest()
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


def _inputs_fingerprint(sizes: dict[str, int]) -> str:
    """The cleaned parts' names and sizes (path -> bytes)."""
    h = hashlib.sha256()
    for f, size in sizes.items():
        h.update(f"{f.rsplit('/', 1)[-1]}\t{size}\n".encode())
    return h.hexdigest()


def read_text_batches(files: list[str]):
    """Yield lists of document texts in corpus order (files sorted, rows in order); a null text or
    an unreadable file is a ShardDataError naming it."""
    for path in files:
        yield from _checked(path, iter_text_batches(path, batch_rows=READ_ROWS), 0)


def read_text_rows(path: str, start: int, stop: int) -> Iterator[list[str]]:
    """Lists of the texts of rows [start, stop) of one cleaned part, in order (readers.py:
    parquet_text_rows reads only the row groups that hold them). A null text or an unreadable
    file is a ShardDataError naming it (and the row)."""
    yield from _checked(path, parquet_text_rows(path, start, stop, batch_rows=READ_ROWS), start)


def _checked(path: str, batches: Iterator[list], row: int) -> Iterator[list[str]]:
    """`batches` of `path` from row `row` on, bad input as a ShardDataError naming the file."""
    try:
        for texts in batches:
            if None in texts:
                raise ShardDataError(f"{path}: row {row + texts.index(None)}: text is null")
            yield texts
            row += len(texts)
    except BadInputFile as e:
        raise ShardDataError(str(e)) from None


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


# --- settings, tokenizer --------------------------------------------------------------------------


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
    if s.workers < 0:
        raise ShardError(f"data.shard.workers must be >= 0 (0: auto), got {s.workers}")
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
        raise ShardDataError(str(e)) from None
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


def _refuse_other_settings(stage: Stage, settings: dict) -> None:
    """An existing output (manifest or started run) must come from the same settings: never mix two
    runs in one folder."""
    state = existing_state(stage.out)
    if state is None:
        return
    diff = mismatch(state.get("settings") or {}, settings)
    if diff:
        what = (
            "another tokenizer"
            if any(d.startswith("tokenizer_sha256") for d in diff)
            else "other settings"
        )
        stage.refuse(
            f"holds shards made with {what} ({'; '.join(diff)})",
            f"remove {stage.out} or pass another --out",
        )


def _encoder_threads(where: Where, n_units: int) -> int:
    """Encoder threads per process for n_units encode units; 0 leaves them alone. In this process
    (run_units runs one unit, or workers=1, here) tokenizers uses every core; Ray's runtime sets 1
    thread a task; N local processes share the cores."""
    if where.executor != "local" or where.workers == 1 or n_units <= 1:
        return 0
    return max(1, cores() // min(where.workers, n_units))


def _listing(folder: str) -> dict[str, int]:
    """Size of every file under `folder` by its path relative to it ({} when there is none): one
    listing, not a request a file."""
    fs, p = fsio.filesystem(folder)
    fs.invalidate_cache()
    if not fs.exists(p):
        return {}
    root = p.rstrip("/") + "/"
    return {
        name[len(root) :]: int(info.get("size") or 0)
        for name, info in fs.find(p, detail=True).items()
        if name.startswith(root)
    }


def _read_markers(paths: list[str]) -> list[dict | None]:
    """The JSON of each path (None for one that is unreadable), read concurrently on an object
    store, where each is a request."""

    def read(path: str) -> dict | None:
        try:
            m = fsio.read_json(path)
        except (ValueError, FileNotFoundError):
            return None
        return m if isinstance(m, dict) else None

    if not paths or not fsio.is_remote(paths[0]):
        return [read(p) for p in paths]
    with cf.ThreadPoolExecutor(16) as pool:
        return list(pool.map(read, paths))


# --- scan: documents per split, before any encoding -----------------------------------------------


@dataclass
class _ScanUnit:
    path: str
    val_fraction: float
    start: int = 0  # rows [start, stop) of the part; stop -1: to its end
    stop: int = -1
    block_rows: int = 0  # the driver's BLOCK_ROWS (a worker process may hold another)


def shard_scan_unit(u: _ScanUnit) -> dict:
    """One part (or rows of it): its rows, documents per split, smallest split value (to suggest
    a val_fraction), and running counts sampled at rows 0, BLOCK_ROWS, 2 x BLOCK_ROWS, ... and its
    last row ("rows_at"): the UTF-8 bytes ("bytes_at") and val documents ("val_at") before each.
    _cuts may cut the part into encode units at those rows, and each unit's documents come from
    them. Rows [start, stop) count from start (a part's are added up by _joined_scans)."""
    min_value = 1.0
    block = u.block_rows or BLOCK_ROWS
    rows_at, bytes_at, val_at = [u.start], [0], [0]
    n_bytes = n_val = 0
    row = u.start
    reader = (
        read_text_batches([u.path])
        if u.start == 0 and u.stop < 0
        else read_text_rows(u.path, u.start, u.stop)
    )
    for texts in reader:
        for text in texts:
            data = text.encode("utf-8")
            v = _split_value(data)
            min_value = min(min_value, v)
            n_bytes += len(data)
            n_val += v < u.val_fraction
            row += 1
            if row % block == 0:
                rows_at.append(row)
                bytes_at.append(n_bytes)
                val_at.append(n_val)
    if row % block and row > u.start:
        rows_at.append(row)
        bytes_at.append(n_bytes)
        val_at.append(n_val)
    return {
        "documents": {"train": row - u.start - n_val, "val": n_val},
        "min_value": min_value,
        "rows": row,
        "rows_at": np.array(rows_at, np.int64),
        "bytes_at": np.array(bytes_at, np.int64),
        "val_at": np.array(val_at, np.int64),
    }


def _scan_units(files: list[str], val_fraction: float, want: int) -> list[_ScanUnit]:
    """A unit per part; with fewer parts than `want` units, each part is cut at row groups (about
    equal bytes) into as many as make that up (scan_corpus says how many)."""
    if len(files) >= want or not files:
        return [_ScanUnit(f, val_fraction, block_rows=BLOCK_ROWS) for f in files]
    per_part = -(-want // len(files))
    units = []
    for f in files:
        try:
            with fsio.open(f, "rb") as fh:
                meta = pq.ParquetFile(fh).metadata
        except Exception as e:
            raise ShardDataError(f"{f}: not a readable parquet file ({e})") from None
        sizes = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
        rows = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        at = np.cumsum([0] + sizes)
        # the row group where each cut's share of the bytes begins
        cuts = np.searchsorted(at, np.linspace(0, at[-1], per_part + 1)[1:-1])
        bounds = sorted({0, *rows[cuts].tolist(), int(rows[-1])})
        ranges = list(itertools.pairwise(bounds)) or [(0, -1)]  # an empty part: one unit
        units += [_ScanUnit(f, val_fraction, a, b, BLOCK_ROWS) for a, b in ranges]
    return units


def _joined_scans(parts: list[tuple[int, dict]]) -> dict:
    """One part's scan from the scans of its row ranges (start row, scan): counts added up, and
    the samples at a range's end that are not on a BLOCK_ROWS boundary left out (the part's
    samples are the same wherever the scan was cut)."""
    parts = sorted(parts, key=lambda p: p[0])
    if len(parts) == 1:
        return parts[0][1]
    rows, nbytes, nval = [np.zeros(1, np.int64) for _ in range(3)]
    for _, r in parts:
        keep = r["rows_at"][1:]
        rows = np.concatenate([rows, keep])
        nbytes = np.concatenate([nbytes, r["bytes_at"][1:] + nbytes[-1]])
        nval = np.concatenate([nval, r["val_at"][1:] + nval[-1]])
    last = parts[-1][1]["rows"]
    on_grid = (rows % BLOCK_ROWS == 0) | (rows == last)
    return {
        "documents": {sp: sum(r["documents"][sp] for _, r in parts) for sp in SPLITS},
        "min_value": min(r["min_value"] for _, r in parts),
        "rows": last,
        "rows_at": rows[on_grid],
        "bytes_at": nbytes[on_grid],
        "val_at": nval[on_grid],
    }


def scan_corpus(files: list[str], val_fraction: float, where: Where) -> dict[str, dict]:
    """{part: its documents per split}; an impossible split is a ShardError now, not after hours of
    tokenization."""
    # one bar for the stage (the encoding's): the scan and the write report one line each
    # Units: one a worker (a Ray CPU), and UNITS_PER_WORKER a worker for a local pool, whose
    # processes start (spawn, imports, the encoder) during this phase: this process scans from
    # the front meanwhile, and each pool process joins for what is left once it is up (with one
    # unit a worker, this process's second would have waited for a process still importing).
    side_by_side = slots(where) if where.parallel else 1
    local = where.executor == "local" and side_by_side > 1
    units = _scan_units(files, val_fraction, side_by_side * (UNITS_PER_WORKER if local else 1))
    scans: dict[str, list] = {f: [] for f in files}
    for u, r in run_units(shard_scan_unit, units, where):
        scans[u.path].append((u.start, r))
    found = {f: _joined_scans(scans[f]) for f in files}
    docs = {sp: sum(r["documents"][sp] for r in found.values()) for sp in SPLITS}
    log.info(
        "shard: %d parts hold %d train and %d val documents", len(files), docs["train"], docs["val"]
    )
    n = sum(docs.values())
    if n == 0:
        raise ShardError(
            f"empty corpus: the {len(files)} cleaned parquet file(s) hold no documents"
        )
    if docs["val"] == 0:
        min_value = min(r["min_value"] for r in found.values())
        raise ShardError(
            f"val_fraction={val_fraction} puts none of the {n} documents into validation: "
            f"use --val-fraction {_suggest_fraction(min_value)} or larger"
        )
    if docs["train"] == 0:
        raise ShardError(
            f"val_fraction={val_fraction} puts all {n} documents into validation: lower it"
        )
    return found


# --- encode: one part -> its token streams in .units/ ---------------------------------------------


@dataclass
class _EncodeUnit:
    """Rows [start, stop) of one part to encode, with everything a worker process or Ray task needs
    (picklable)."""

    index: int  # the part's place in corpus order
    path: str
    units_dir: str
    tokenizer_path: str
    tokenizer_sha256: str
    bos: int
    eos: int
    append_eos: bool
    dtype: str
    chunk_chars: int
    val_fraction: float
    fingerprint: str  # of the settings: a marker of other settings is not this unit's
    start: int = 0  # the part's rows [start, stop)
    stop: int = 0
    documents: dict[str, int] = field(default_factory=dict)  # in those rows per split (the scan's)
    threads: int = 0  # encoder threads of the process that runs it; 0: leave them alone

    @property
    def folder(self) -> str:
        """NNNNN-PART-rows-START-STOP: a rerun that cuts the parts elsewhere (other --workers)
        never takes another range's files for this one's."""
        name = fsio.basename(self.path).removesuffix(".parquet")
        return fsio.join(self.units_dir, f"{self.index:05d}-{name}-rows-{self.start}-{self.stop}")

    def file(self, name: str) -> str:
        return fsio.join(self.folder, name)


# one tokenizer per process, loaded by its first unit
_encoders: dict[tuple, tuple[Encoder, EncodeWith]] = {}


def _encoder_for(u: _EncodeUnit) -> tuple[Encoder, EncodeWith]:
    key = (u.tokenizer_sha256, u.bos, u.eos, u.append_eos, u.dtype, u.chunk_chars)
    if key not in _encoders:
        data = fsio.read_bytes(u.tokenizer_path)
        if hashlib.sha256(data).hexdigest() != u.tokenizer_sha256:
            raise ShardError(
                f"{u.tokenizer_path} changed while shards were being made from it: rerun "
                "`codex data shard` once `codex data tokenize` has finished"
            )
        encoder = Encoder(data.decode("utf-8"), u.bos, u.eos, u.append_eos, u.dtype, u.chunk_chars)
        _encoders.clear()
        _encoders[key] = (encoder, encoder.load())
    return _encoders[key]


def shard_load_encoder(u: _EncodeUnit) -> None:
    """Load the encoder of u's settings into this process (a pool worker, before its units)."""
    _encoder_for(u)


def shard_encode_unit(u: _EncodeUnit) -> dict:
    """Encode the unit's rows of its part into its folder of .units/; returns its marker (part,
    rows, documents, tokens per split, UTF-8 bytes). Removes what an earlier attempt left there
    first and writes the marker last, so a marker always vouches for complete files."""
    started = time.time()
    fsio.rm(u.folder, recursive=True)
    if u.threads:
        # N processes x `threads` threads should not oversubscribe the cores. tiktoken reads it
        # on every call; rayon once, when tokenizers first builds its thread pool in a process,
        # so in the driver that pool keeps this size after the stage: only HF batch encodes use
        # it, and a `codex data` command ends with its stage
        os.environ["RAYON_NUM_THREADS"] = str(u.threads)
    encoder, tok = _encoder_for(u)
    counts = fsio.with_retries(lambda: _encode_to_files(u, encoder, tok), u.folder)
    marker = {
        "part": fsio.basename(u.path),
        "rows": [u.start, u.stop],
        "fingerprint": u.fingerprint,
        # who ran it and when: for the log and the curious, never part of the output
        "worker": worker_id(),
        "started": started,
        "finished": time.time(),
        **counts,
    }
    path = u.file(UNIT_DONE)
    fsio.with_retries(lambda: fsio.write_json(path, marker), path)
    return marker


def _encode_to_files(u: _EncodeUnit, encoder: Encoder, tok: EncodeWith) -> dict:
    """Stream the unit's documents through the encoder into SPLIT.tokens (ids, in order) and
    SPLIT.lens (tokens per document, int64)."""
    documents = dict.fromkeys(SPLITS, 0)
    tokens = dict.fromkeys(SPLITS, 0)
    lens: dict[str, list[np.ndarray]] = {sp: [] for sp in SPLITS}
    n_bytes = 0
    with contextlib.ExitStack() as stack:
        files = {sp: stack.enter_context(fsio.atomic_open(u.file(f"{sp}.tokens"))) for sp in SPLITS}

        def encode(texts: list[str], is_val: list[bool]) -> None:
            flat, per_doc = encoder.encode(tok, texts)
            val = np.array(is_val, bool)
            for sp, sel in (("train", ~val), ("val", val)):
                if sel.all():
                    ids, n = flat, per_doc
                elif sel.any():
                    ids, n = flat[np.repeat(sel, per_doc)], per_doc[sel]
                else:
                    continue
                files[sp].write(ids.tobytes())
                lens[sp].append(n)
                tokens[sp] += len(ids)
                documents[sp] += len(n)

        batch: list[str] = []
        is_val: list[bool] = []
        chars = 0
        for texts in read_text_rows(u.path, u.start, u.stop):
            for text in texts:
                data = text.encode("utf-8")
                n_bytes += len(data)
                batch.append(text)
                is_val.append(_split_value(data) < u.val_fraction)
                chars += len(text)
                if chars >= BATCH_CHARS:
                    encode(batch, is_val)
                    batch, is_val, chars = [], [], 0
        if batch:
            encode(batch, is_val)
    for sp in SPLITS:
        per_doc = np.concatenate(lens[sp]) if lens[sp] else np.zeros(0, np.int64)
        fsio.write_bytes(u.file(f"{sp}.lens"), per_doc.astype("<i8").tobytes())
    return {"documents": documents, "tokens": tokens, "bytes": n_bytes}


def _encoded(units: list[_EncodeUnit], itemsize: int) -> dict[str, dict]:
    """{unit folder: marker} of the units an earlier run encoded with these settings (same part,
    same rows), whose files are all there (sizes as the marker says) and whose document counts
    match the scan."""
    if not units:
        return {}
    sizes = _listing(units[0].units_dir)

    def rel(u: _EncodeUnit, name: str) -> str:
        return f"{fsio.basename(u.folder)}/{name}"

    found = [u for u in units if rel(u, UNIT_DONE) in sizes]
    done = {}
    for u, m in zip(found, _read_markers([u.file(UNIT_DONE) for u in found]), strict=True):
        if (
            m is None
            or m.get("fingerprint") != u.fingerprint
            or m.get("part") != fsio.basename(u.path)
            or m.get("rows") != [u.start, u.stop]
            or m.get("documents") != u.documents
        ):
            continue
        if all(
            sizes.get(rel(u, f"{sp}.tokens")) == m["tokens"][sp] * itemsize
            and sizes.get(rel(u, f"{sp}.lens")) == m["documents"][sp] * 8
            for sp in SPLITS
        ):
            done[u.folder] = m
    return done


def _encode_phase(units: list[_EncodeUnit], where: Where) -> list[dict]:
    """Every unit's marker, in corpus order; encodes the units that have none."""
    itemsize = np.dtype(units[0].dtype).itemsize
    markers = _encoded(units, itemsize)
    todo = [u for u in units if u.folder not in markers]
    threads = _encoder_threads(where, len(todo))
    for u in todo:
        u.threads = threads
    total = sum(sum(u.documents.values()) for u in todo)
    with Progress("shard", total=total, unit="docs", enabled=bool(todo)) as prog:
        for u, m in run_units(shard_encode_unit, todo, where):
            if m["documents"] != u.documents:
                raise RuntimeError(
                    f"shard: {u.path} changed while it was read (rows [{u.start}, {u.stop}) held "
                    f"{u.documents} documents, then {m['documents']})"
                )
            markers[u.folder] = m
            prog.update(
                sum(m["documents"].values()), tokens=sum(m["tokens"].values()), bytes=m["bytes"]
            )
    parts = len({u.index for u in units})
    log.info(
        "shard: encoded %d of %d units of %d parts (%d done by an earlier run)",
        len(todo),
        len(units),
        parts,
        len(units) - len(todo),
    )
    return [markers[u.folder] for u in units]


# --- write: consecutive shards of one split from the units' token files ---------------------------


@dataclass
class _Source:
    """One encode unit's tokens of a split, and where they start in the split's token stream."""

    tokens_path: str
    lens_path: str
    start: int
    tokens: int


@dataclass
class _WriteSettings:
    """What every write task shares."""

    shard_tokens: int
    dtype: str
    formats: list[str]
    out: str
    markers_dir: str
    fingerprint: str  # of the settings: a marker of other settings is not this shard's


@dataclass
class _WriteTask:
    """Shards first..stop-1 of a split, with the units that hold their tokens (picklable)."""

    split: str
    first: int
    stop: int
    total: int  # tokens in the split
    sources: list[_Source]
    # shard index -> {"entries": what an earlier run wrote, "checked": its files were found to
    # match just now, "marked": it has its marker}; a shard not here, or whose files no longer
    # match, is written
    earlier: dict[int, dict]
    w: _WriteSettings


class _SplitReader:
    """Token ranges of one split's stream, read from the units' files: only the slices asked for."""

    def __init__(self, sources: list[_Source], dtype: str):
        self.sources = sources
        self.starts = [s.start for s in sources]
        self.dtype = np.dtype(dtype)
        self.files: dict[int, IO] = {}
        self.doc_starts: dict[int, np.ndarray] = {}

    def __enter__(self) -> _SplitReader:
        return self

    def __exit__(self, *exc) -> None:
        for f in self.files.values():
            f.close()

    def _overlapping(self, a: int, b: int) -> list[int]:
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        found = []
        while i < len(self.sources) and self.sources[i].start < b:
            s = self.sources[i]
            if s.start + s.tokens > a:
                found.append(i)
            i += 1
        return found

    def tokens(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the split."""
        for i in [i for i in self.files if self.sources[i].start + self.sources[i].tokens <= a]:
            self.files.pop(i).close()  # shards go forward: a unit behind them is done with
            self.doc_starts.pop(i, None)
        buf = np.empty(b - a, self.dtype)
        size, filled = self.dtype.itemsize, 0
        for i in self._overlapping(a, b):
            s = self.sources[i]
            lo, hi = max(a, s.start), min(b, s.start + s.tokens)
            if i not in self.files:
                self.files[i] = fsio.open(s.tokens_path, "rb")
            f = self.files[i]
            f.seek((lo - s.start) * size)
            data = f.read((hi - lo) * size)
            if len(data) != (hi - lo) * size:
                raise RuntimeError(f"shard: {s.tokens_path} is shorter than its marker says")
            buf[lo - a : hi - a] = np.frombuffer(data, self.dtype)
            filled += hi - lo
        if filled != b - a:
            raise RuntimeError(f"shard: tokens [{a}, {b}) are not all in the units: internal error")
        return buf

    def documents(self, a: int, b: int) -> int:
        """Documents whose <|bos|> (first token) lies in [a, b)."""
        n = 0
        for i in self._overlapping(a, b):
            if i not in self.doc_starts:
                s = self.sources[i]
                lens = np.frombuffer(fsio.read_bytes(s.lens_path), "<i8")
                self.doc_starts[i] = s.start + np.concatenate([[0], np.cumsum(lens)[:-1]])
            starts = self.doc_starts[i]
            n += int(np.searchsorted(starts, b) - np.searchsorted(starts, a))
        return n


def _shard_marker(markers_dir: str, split: str, index: int) -> str:
    return fsio.join(markers_dir, f"{split}_{index:05d}.json")


def shard_write_unit(t: _WriteTask) -> dict:
    """Write the task's shards (each: its files, then its marker), keeping those an earlier run
    wrote whose files still match. {"shards": {index: entries}, "written": how many were
    written}."""
    w = t.w
    done: dict[int, list[dict]] = {}
    written = 0
    with _SplitReader(t.sources, w.dtype) as reader:
        for k in range(t.first, t.stop):
            earlier = t.earlier.get(k)
            if earlier is not None and (
                earlier["checked"]
                or all(
                    file_matches(fsio.join(w.out, e["path"]), e["sha256"])
                    for e in earlier["entries"]
                )
            ):
                done[k] = earlier["entries"]
                if earlier["marked"]:
                    continue
            else:
                a, b = k * w.shard_tokens, min((k + 1) * w.shard_tokens, t.total)
                tokens = reader.tokens(a, b)
                documents = reader.documents(a, b)
                done[k] = []
                for fmt in w.formats:
                    name = shard_name(t.split, k, fmt)
                    writer = write_npy if fmt == "npy" else write_parquet
                    sha, _ = writer(fsio.join(w.out, name), tokens)
                    done[k].append(shard_entry(t.split, name, fmt, b - a, documents, sha))
                written += 1
            _write_marker(
                _shard_marker(w.markers_dir, t.split, k),
                {"fingerprint": w.fingerprint, "entries": done[k]},
            )
    return {"shards": done, "written": written}


def _write_marker(path: str, marker: dict) -> None:
    fsio.with_retries(lambda: fsio.write_json(path, marker), path)


def _earlier_shards(
    markers_dir: str, fingerprint: str, formats: list[str], previous: list[dict]
) -> dict[tuple[str, int], dict]:
    """{(split, index): earlier} (see _WriteTask.earlier) from the shards' markers and from the
    entries of a previous manifest whose files were checked just now."""
    earlier: dict[tuple[str, int], dict] = {}
    by_path = {e["path"]: e for e in previous}
    for (sp, k), names in _shard_names(by_path, formats).items():
        earlier[(sp, k)] = {
            "entries": [by_path[n] for n in names],
            "checked": True,
            "marked": False,
        }
    paths = [p for p in fsio.listdir(markers_dir) if p.endswith(".json")]
    for path, m in zip(paths, _read_markers(paths), strict=True):
        sp, _, index = fsio.basename(path).removesuffix(".json").partition("_")
        if m is None or m.get("fingerprint") != fingerprint or not index.isdigit():
            continue
        k = int(index)
        names = [shard_name(sp, k, fmt) for fmt in formats]
        entries = m.get("entries")
        if isinstance(entries, list) and [e.get("path") for e in entries] == names:
            if (sp, k) not in earlier:
                earlier[(sp, k)] = {"entries": entries, "checked": False, "marked": True}
            else:
                earlier[(sp, k)]["marked"] = True
    return earlier


def _shard_names(by_path: dict[str, dict], formats: list[str]) -> dict[tuple[str, int], list]:
    """The shards all of whose files (one per format) are in by_path: {(split, index): names}."""
    found = {}
    for e in by_path.values():
        sp, index = e["split"], e["path"].split("_")[-1].split(".")[0]
        if sp in SPLITS and index.isdigit():
            names = [shard_name(sp, int(index), fmt) for fmt in formats]
            if all(n in by_path for n in names):
                found[(sp, int(index))] = names
    return found


def _write_phase(
    units: list[_EncodeUnit],
    markers: list[dict],
    w: _WriteSettings,
    previous: list[dict],
    where: Where,
) -> dict[str, list[list[dict]]]:
    """Every split's shards, each a list of entries (one per format), from the units' markers (in
    corpus order) and the entries of the previous manifest whose files still match."""
    earlier = _earlier_shards(w.markers_dir, w.fingerprint, w.formats, previous)
    tasks: list[_WriteTask] = []
    counts = {sp: -(-sum(m["tokens"][sp] for m in markers) // w.shard_tokens) for sp in SPLITS}
    # UNITS_PER_WORKER tasks a slot where the shards allow, as the encoding's units
    per_task = max(
        1,
        min(
            WRITE_TASK_TOKENS // w.shard_tokens,
            sum(counts.values()) // (UNITS_PER_WORKER * slots(where)),
        ),
    )
    for sp in SPLITS:
        sources, pos = [], 0
        for u, m in zip(units, markers, strict=True):
            n = m["tokens"][sp]
            if n:
                sources.append(_Source(u.file(f"{sp}.tokens"), u.file(f"{sp}.lens"), pos, n))
                pos += n
        starts = [src.start for src in sources]
        for first in range(0, counts[sp], per_task):
            stop = min(counts[sp], first + per_task)
            lo, hi = first * w.shard_tokens, min(stop * w.shard_tokens, pos)
            # the units holding tokens [lo, hi): from the one lo falls in to the last starting
            # before hi
            a, b = max(0, bisect.bisect_right(starts, lo) - 1), bisect.bisect_left(starts, hi)
            mine = {k: earlier[(sp, k)] for k in range(first, stop) if (sp, k) in earlier}
            tasks.append(_WriteTask(sp, first, stop, pos, sources[a:b], mine, w))
    shards: dict[str, dict[int, list[dict]]] = {sp: {} for sp in SPLITS}
    written = 0
    total = sum(counts.values())
    for task, r in run_units(shard_write_unit, tasks, where):
        shards[task.split].update(r["shards"])
        written += r["written"]
    kept = total - written
    log.info("shard: wrote %d of %d shards (%d kept from an earlier run)", written, total, kept)
    return {sp: [shards[sp][k] for k in range(counts[sp])] for sp in SPLITS}


# --- the stage -----------------------------------------------------------------------------------


def shard_check_unit(unit: tuple[str, str]) -> bool:
    return file_matches(*unit)


def _check_shards(out: str, manifest: dict, where: Where) -> tuple[list[dict], list[str]]:
    """(the manifest's entries whose files still match their sha256, what is wrong with the
    others)."""
    entries: dict[tuple[str, str], dict] = {}
    bad = []
    for e in manifest.get("shards", []):
        try:
            path = fsio.join_inside(out, e["path"], f"{fsio.join(out, MANIFEST)}: a shard path")
        except ValueError as err:
            bad.append(str(err))
            continue
        entries[(path, e["sha256"])] = e
    good = []
    for unit, ok in run_units(shard_check_unit, list(entries), where):
        if ok:
            good.append(entries[unit])
        else:
            bad.append(f"{unit[0]} is missing or changed")
    return good, bad


def _encode_template(
    units_dir: str, cfg: Config, meta: dict, dtype: str, fingerprint: str
) -> _EncodeUnit:
    """What every encode unit of this run shares (no part yet)."""
    s = cfg.data.shard
    return _EncodeUnit(
        -1,
        "",
        units_dir,
        fsio.join(rundir.tokenizer_dir(cfg.run), "tokenizer.json"),
        meta["sha256"],
        meta["special_ids"]["bos"],
        meta["special_ids"]["eos"],
        s.append_eos,
        dtype,
        s.chunk_chars,
        s.val_fraction,
        fingerprint,
    )


def _cuts(scans: list[dict], slots: int) -> list[list[int]]:
    """Where each part is cut into encode units (rows, from 0 to its row count). Each part is one
    unit when the parts are at least UNITS_PER_WORKER x slots (or nothing runs side by side);
    otherwise the corpus is cut at the scan's sampled rows into that many ranges of about equal
    UTF-8 bytes, the last `slots` of them in `slots` pieces of 1/2, 1/4, ... 1/2**TAIL_HALVINGS
    their size and `slots` more of the last size (units start in the list's order), so that every
    slot has work until the end and the slots finish together."""
    whole = [[0, r["rows"]] for r in scans]
    want = UNITS_PER_WORKER * slots
    total = sum(int(r["bytes_at"][-1]) for r in scans)
    if slots <= 1 or len(scans) >= want or total == 0:
        return whole
    # where units end, in the corpus's bytes (0 and total left out)
    ends = np.linspace(0, total, want + 1)
    halves = [2.0**-k for k in range(1, TAIL_HALVINGS + 1)] + [2.0**-TAIL_HALVINGS]
    tail = ends[-slots - 1] + np.cumsum([0, *np.repeat(halves, slots)]) * (total / want)
    goals = np.concatenate([ends[1 : -slots - 1], tail[:-1]])
    cuts = []
    offset = 0
    for r in scans:
        at, rows = r["bytes_at"], r["rows_at"]
        size = int(at[-1])
        mine = goals[(goals > offset) & (goals < offset + size)] - offset
        offset += size
        i = np.clip(np.searchsorted(at, mine), 1, len(at) - 1)
        i -= mine - at[i - 1] < at[i] - mine  # the nearer of the two sampled rows
        cut = sorted({0, r["rows"], *rows[i].tolist()})
        cuts.append(cut if len(cut) > 1 else [0, 0])  # an empty part is one (empty) unit
    return cuts


def _encode_units(
    files: list[str], scanned: dict[str, dict], slots: int, template: _EncodeUnit
) -> list[_EncodeUnit]:
    """The encode units in corpus order (see _cuts), each with the documents the scan counted in
    its rows."""
    scans = [scanned[f] for f in files]
    units = []
    for i, (f, r, cut) in enumerate(zip(files, scans, _cuts(scans, slots), strict=True)):
        rows, val_at = r["rows_at"], r["val_at"]
        for a, b in zip(cut, cut[1:], strict=False):
            val = int(val_at[np.searchsorted(rows, b)] - val_at[np.searchsorted(rows, a)])
            documents = {"train": b - a - val, "val": val}
            units.append(replace(template, index=i, path=f, start=a, stop=b, documents=documents))
    if len(units) > len(files):
        log.info(
            "shard: %d parts cut into %d encode units of ~%.1f MB (%d run side by side)",
            len(files),
            len(units),
            sum(int(r["bytes_at"][-1]) for r in scans) / len(units) / 1e6,
            slots,
        )
    return units


def run_shard(cfg: Config) -> dict:
    """Tokenize RUN/clean into shards under cfg.data.shard.out (default RUN/shards); returns the
    manifest."""
    s = cfg.data.shard
    _validate(cfg)
    check_executor(cfg.data)
    stage = Stage(
        "codex data shard", cfg, s.out or rundir.shards_dir(cfg.run), MANIFEST, error=ShardError
    )
    out = stage.out
    units_dir = fsio.join(out, UNITS)
    tok_dir = rundir.tokenizer_dir(cfg.run)
    _, meta = _load_tokenizer(tok_dir)
    dtype = _dtype_for(meta["vocab_size"], s.dtype, tok_dir)
    files = clean_parts(cfg.run)
    sizes = {f: fsio.size(f) for f in files}  # one stat a part (a request on GCS)
    where = where_for(cfg.data, s.workers, sum(sizes.values()), AUTO_BYTES_PER_WORKER)
    settings = _settings(cfg, meta, dtype, _inputs_fingerprint(sizes))
    formats: list[str] = ["npy", "parquet"] if s.format == "both" else [s.format]
    _refuse_other_settings(stage, settings)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    template = _encode_template(units_dir, cfg, meta, dtype, fingerprint)

    # --workers N: one pool of N processes for every phase; they load the encoder while this
    # process checks or scans
    with stage_pool(where, functools.partial(shard_load_encoder, template)) as where:
        previous: list[dict] = []
        manifest = stage.finished()
        if manifest is not None:
            previous, bad = _check_shards(out, manifest, where)
            if not bad:
                log.info(
                    "shard: %s is complete and every shard matches its sha256; nothing to do", out
                )
                # left when a run was killed right after its commit
                fsio.rm(units_dir, recursive=True)
                return manifest
            for problem in bad:
                log.warning("shard: %s; redoing it", problem)

        scanned = scan_corpus(files, s.val_fraction, where)  # fails fast on an impossible split
        stage.start()  # a damaged or unfinished output has no manifest
        fsio.write_json(fsio.join(out, PROGRESS), {"settings": settings})
        remove_temp_files(out)

        units = _encode_units(files, scanned, slots(where), template)
        markers = _encode_phase(units, where)
        w = _WriteSettings(
            s.shard_tokens, dtype, formats, out, fsio.join(units_dir, SHARD_MARKERS), fingerprint
        )
        shards = _write_phase(units, markers, w, previous, where)
    forget_row_group()  # this process's last row group (readers.py), up to 64 MB
    docs = {sp: sum(m["documents"][sp] for m in markers) for sp in SPLITS}
    manifest = build_manifest(shards, settings, meta, dtype, s, docs)
    remove_temp_files(out)  # a write task retried after its worker died may have left one
    stage.commit(manifest)
    fsio.rm(units_dir, recursive=True)
    _log_totals(manifest, out)
    return manifest


def _log_totals(manifest: dict, out: str) -> None:
    per_split = ", ".join(
        f"{sp} {t['tokens']} tokens / {t['documents']} docs / {t['shards']} shards"
        for sp, t in ((sp, manifest["totals"][sp]) for sp in SPLITS)
    )
    log.info("shard: %s -> %s", per_split, out)
