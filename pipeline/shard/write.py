"""The shard stage's third phase, write: consecutive shards of one split from the encode units'
token files, and the shard files themselves (write_npy, write_parquet).

The units' markers say where each unit's tokens start in each split's stream (units in corpus
order), so shard k of a split is that stream's tokens [k * shard_tokens, (k + 1) * shard_tokens)
whoever writes it; a write task takes consecutive shards (~WRITE_TASK_TOKENS, fewer when that would
leave a slot without UNITS_PER_WORKER tasks), reads only the slices of the units' token files they
cover, and writes each shard's files (atomically), then its marker. A rerun keeps the shards whose
marker, or the previous manifest's entry, still matches the file (_earlier_shards).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
from dataclasses import dataclass
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from codex.core import fsio
from codex.pipeline.executor import Where, run_units, slots
from codex.pipeline.shard.encode import UNITS_PER_WORKER, EncodeUnit
from codex.pipeline.shard.manifest import (
    SPLITS,
    file_matches,
    read_markers,
    shard_entry,
    shard_name,
)

log = logging.getLogger("codex.shard")

PARQUET_ROW_GROUP = 1 << 20  # tokens per row group in parquet shards
# tokens per write task (whole shards, at least one): small shards are grouped so that a task is
# worth scheduling, but never so many that a slot has no task (write_phase)
WRITE_TASK_TOKENS = 64 << 20


# --- shard files ----------------------------------------------------------------------------------


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


def write_shard(
    out: str, split: str, index: int, tokens: np.ndarray, documents: int, formats: list[str]
) -> list[dict]:
    """Shard `index` of `split` in `out`: its file in each format (atomically), and their manifest
    entries. Every shard file is written here: the stage's write tasks, and `codex eval --data`'s
    one temporary shard (eval/data.py)."""
    entries = []
    for fmt in formats:
        name = shard_name(split, index, fmt)
        writer = write_npy if fmt == "npy" else write_parquet
        sha, _ = writer(fsio.join(out, name), tokens)
        entries.append(shard_entry(split, name, fmt, len(tokens), documents, sha))
    return entries


# --- write tasks ----------------------------------------------------------------------------------


@dataclass
class _Source:
    """One encode unit's tokens of a split, and where they start in the split's token stream."""

    tokens_path: str
    lens_path: str
    start: int
    tokens: int


@dataclass
class WriteSettings:
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
    w: WriteSettings


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
                tokens, documents = reader.tokens(a, b), reader.documents(a, b)
                done[k] = write_shard(w.out, t.split, k, tokens, documents, w.formats)
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
    for path, m in zip(paths, read_markers(paths), strict=True):
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


def write_phase(
    units: list[EncodeUnit],
    markers: list[dict],
    w: WriteSettings,
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
