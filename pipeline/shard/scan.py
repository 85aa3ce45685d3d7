"""The shard stage's first phase, scan: each cleaned part's documents per split, counted before any
encoding, so that an empty corpus or an empty val split fails in seconds.

When encode.py will cut the parts into encode units (_cuts), a unit also samples, every BLOCK_ROWS
rows, the UTF-8 bytes and val documents before that row: where a part may be cut. With fewer
parts than units wanted, a part is scanned in row ranges cut at its row groups and their counts
added up (_scan_units, _joined_scans). docs/stages.md, "A scan unit", has the details.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from codex.core import fsio
from codex.pipeline.executor import Where, run_units, slots
from codex.pipeline.shard.corpus import read_text_batches, read_text_rows, split_value_bytes
from codex.pipeline.shard.encode import UNITS_PER_WORKER
from codex.pipeline.shard.errors import ShardDataError, ShardError
from codex.pipeline.shard.manifest import SPLITS, per_path

log = logging.getLogger("codex.shard")

# rows between the places where the scan records its running counts: where a part may be cut into
# several encode units
BLOCK_ROWS = 64


@dataclass
class _ScanUnit:
    """Rows of one part to scan (picklable)."""

    path: str
    val_fraction: float
    start: int = 0  # rows [start, stop) of the part; stop -1: to its end
    stop: int = -1
    block_rows: int = 0  # the driver's BLOCK_ROWS (a worker process may hold another)
    samples: bool = True  # sample every block_rows rows; False: only the start and the end


def shard_scan_unit(u: _ScanUnit) -> dict:
    """One part (or rows of it): its rows, documents per split, smallest split value (to suggest
    a val_fraction), and running counts sampled at rows 0, BLOCK_ROWS, 2 x BLOCK_ROWS, ... and its
    last row ("rows_at"): the UTF-8 bytes ("bytes_at") and val documents ("val_at") before each.
    encode.py's _cuts may cut the part into encode units at those rows, and each unit's documents
    come from them. Rows [start, stop) count from start (a part's are added up by
    _joined_scans)."""
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
            v = split_value_bytes(data)
            min_value = min(min_value, v)
            n_bytes += len(data)
            n_val += v < u.val_fraction
            row += 1
            if u.samples and row % block == 0:
                rows_at.append(row)
                bytes_at.append(n_bytes)
                val_at.append(n_val)
    if row > rows_at[-1]:
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


def _row_groups(path: str) -> tuple[list[int], list[int]]:
    """A part's row groups from its parquet footer: (bytes, rows) of each."""
    try:
        with fsio.open(path, "rb") as fh:
            meta = pq.ParquetFile(fh).metadata
    except Exception as e:
        if fsio.is_store_failure(e):  # the storage failed, not the part
            raise
        raise ShardDataError(f"{path}: not a readable parquet file ({e})") from None
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    return [g.total_byte_size for g in groups], [g.num_rows for g in groups]


def _scan_units(
    files: list[str], val_fraction: float, want: int, samples: bool = True
) -> list[_ScanUnit]:
    """A unit per part; with fewer parts than `want` units, each part is cut at row groups (about
    equal bytes) into as many as make that up (scan_corpus says how many), their footers read
    side by side (per_path)."""
    if len(files) >= want or not files:
        return [_ScanUnit(f, val_fraction, block_rows=BLOCK_ROWS, samples=samples) for f in files]
    per_part = -(-want // len(files))
    units = []
    for f, (sizes, n_rows) in zip(files, per_path(_row_groups, files), strict=True):
        rows = np.cumsum([0, *n_rows])
        at = np.cumsum([0, *sizes])
        # the row group where each cut's share of the bytes begins
        cuts = np.searchsorted(at, np.linspace(0, at[-1], per_part + 1)[1:-1])
        bounds = sorted({0, *rows[cuts].tolist(), int(rows[-1])})
        ranges = list(itertools.pairwise(bounds)) or [(0, -1)]  # an empty part: one unit
        units += [_ScanUnit(f, val_fraction, a, b, BLOCK_ROWS, samples) for a, b in ranges]
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
    n_slots = slots(where)
    side_by_side = n_slots if where.parallel else 1
    local = where.executor == "local" and side_by_side > 1
    # encode.py's _cuts cuts the parts (at the samples) only when they are fewer than this
    samples = n_slots > 1 and len(files) < UNITS_PER_WORKER * n_slots
    want = side_by_side * (UNITS_PER_WORKER if local else 1)
    units = _scan_units(files, val_fraction, want, samples)
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


def _suggest_fraction(min_value: float) -> str:
    """The smallest 2-significant-digit fraction that puts at least one document into val."""
    if min_value <= 0:
        return "1e-6"
    digits = -math.floor(math.log10(min_value)) + 1
    v = math.ceil(min_value * 10**digits * 1.0000001) / 10**digits
    if v <= min_value:
        v += 10**-digits
    return f"{v:.{digits}f}".rstrip("0").rstrip(".")
