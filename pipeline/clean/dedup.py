"""Exact dedup across the whole corpus: the last step of `codex data clean`, one shuffle.

Each unit already dropped the copies inside itself and wrote the 128-bit BLAKE2b hash (+ byte
length) of every document it kept to hashes/UNIT.npy, sorted by hash, with its count of hashes
per top-byte bucket in its marker. Then:

    map       (done by the units)  hashes sorted by value: a hash partition is a row range
    reduce    one task per partition: read that row range of every unit's hash file, keep the
              first occurrence in corpus order (the unit order), write the later copies to
              dedup/drops-PPPP.npy sorted by unit
    rewrite   one task per group of units: read the group's rows of every drops file, rewrite
              each part that holds a later copy without it

The number of partitions is the smallest power of two that keeps a partition's hashes under
data.clean.dedup.partition_bytes, so a reduce task holds about that much (plus its sort's
working copies) whatever the corpus size. Decisions are those of a single pass over the corpus
in order: the first copy is kept. Every write is atomic and rows are matched by hash, not
position, so a rerun after a kill redoes the dedup and gets the same result.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from codex.core import fsio
from codex.core.config import ConfigError
from codex.pipeline.clean.parts import bool_array, string_array
from codex.pipeline.executor import Where, run_units
from codex.pipeline.readers import read_part

HASH_BUCKETS = 256  # a unit's marker counts its kept hashes per top byte: the finest partition
HASH_ROW_BYTES = 24  # per kept document: 16-byte hash + 8-byte length, as three uint64
REWRITE_GROUP = 4  # units per rewrite task: small, so rewrites spread over the cluster


def hash_buckets(hashes: np.ndarray) -> list[int]:
    """Kept hashes per top-byte bucket of a unit's sorted (n, 3) uint64 hash array."""
    return np.bincount(hashes[:, 0] >> np.uint64(56), minlength=HASH_BUCKETS).tolist()


def partitions_for(total_docs: int, partition_bytes: int) -> int:
    """The smallest power of two P with total_docs * 24 / P <= partition_bytes."""
    p = 1
    while total_docs * HASH_ROW_BYTES > p * partition_bytes:
        p *= 2
    if p > HASH_BUCKETS:
        raise ConfigError(
            f"data.clean.dedup.partition_bytes={partition_bytes} would need {p} hash partitions "
            f"for {total_docs} documents (at most {HASH_BUCKETS}): raise it to at least "
            f"{-(-total_docs * HASH_ROW_BYTES // HASH_BUCKETS)}"
        )
    return p


def read_rows(path: str, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of a 2-D uint64 .npy file, reading only those bytes (local or gs://)."""
    with fsio.open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
        width = shape[1] * dtype.itemsize
        fh.seek(fh.tell() + lo * width)
        data = fh.read((hi - lo) * width)
    return np.frombuffer(data, dtype=dtype).reshape(-1, shape[1])


# --- reduce: one hash partition --------------------------------------------------------------


@dataclass
class PartitionJob:
    out: str
    index: int
    # (unit's position in corpus order, hash file, first row, end row) of this partition
    sources: list[tuple[int, str, int, int]]
    group_bounds: list[int]  # unit positions where rewrite groups start (and the end)


def drops_path(out: str, index: int) -> str:
    return fsio.join(out, "dedup", f"drops-{index:04d}.npy")


def dedup_partition(job: PartitionJob) -> dict:
    """Later copies within one hash partition -> dedup/drops-PPPP.npy as (unit, h0, h1, bytes)
    rows sorted by unit; returns their count, bytes and the row offsets of each rewrite group."""
    parts, owners = [], []
    for position, path, lo, hi in job.sources:
        if hi > lo:
            parts.append(read_rows(path, lo, hi))
            owners.append(np.full(hi - lo, position, dtype=np.uint64))
    if parts:
        h, owner = np.concatenate(parts), np.concatenate(owners)
        del parts, owners
        order = np.lexsort((owner, h[:, 1], h[:, 0]))  # by hash, then corpus order
        h, owner = h[order], owner[order]
        del order
        repeat = np.zeros(len(h), dtype=bool)
        repeat[1:] = (h[1:, 0] == h[:-1, 0]) & (h[1:, 1] == h[:-1, 1])
        drops = np.column_stack([owner[repeat], h[repeat]])
        drops = drops[np.argsort(drops[:, 0], kind="stable")]
    else:
        drops = np.zeros((0, 4), dtype=np.uint64)
    with fsio.atomic_open(drops_path(job.out, job.index), "wb") as fh:
        np.save(fh, drops)
    offsets = np.searchsorted(drops[:, 0], np.array(job.group_bounds, dtype=np.uint64))
    return {
        "docs": len(drops),
        "bytes": int(drops[:, 3].sum()),
        "offsets": offsets.tolist(),
    }


# --- rewrite: one group of units -------------------------------------------------------------


@dataclass
class RewriteJob:
    out: str
    c: object  # CleanConfig
    units: list[tuple[int, list[str]]]  # (position in corpus order, its parts)
    ranges: list[tuple[str, int, int]]  # (drops file, first row, end row) for these units


def rewrite_group(job: RewriteJob) -> int:
    """Rewrite the parts of a group of units without their later copies; returns parts
    rewritten."""
    rows = [read_rows(path, lo, hi) for path, lo, hi in job.ranges if hi > lo]
    drops = np.concatenate(rows) if rows else np.zeros((0, 4), dtype=np.uint64)
    rewritten = 0
    for position, parts in job.units:
        mine = drops[drops[:, 0] == position]
        if len(mine):
            drop = {row[1:3].tobytes(): int(row[3]) for row in mine}
            rewritten += rewrite_without(job.out, parts, drop, job.c)
    return rewritten


def rewrite_without(out: str, parts: list[str], drop: dict[bytes, int], c) -> int:
    """Rewrite a unit's parts without the rows whose text hash is in `drop` (idempotent)."""
    rewritten = 0
    for name in parts:
        path = fsio.join(out, name)
        table = read_part(path)
        texts = table.column("text").to_pylist()
        keep = [
            hashlib.blake2b(t.encode("utf-8"), digest_size=16).digest() not in drop for t in texts
        ]
        if all(keep):
            continue
        if c.keep_rejected:
            gone = table.filter(bool_array([not k for k in keep]))
            gone = gone.append_column("reason", string_array(["dedup:duplicate"] * len(gone)))
            with fsio.atomic_open(
                fsio.join(out, "rejected", name.replace(".parquet", "-dedup.parquet")), "wb"
            ) as fh:
                pq.write_table(gone, fh, compression="zstd", row_group_size=c.row_group_size)
        with fsio.atomic_open(path, "wb") as fh:
            pq.write_table(
                table.filter(bool_array(keep)),
                fh,
                compression="zstd",
                row_group_size=c.row_group_size,
            )
        rewritten += 1
    return rewritten


# --- the whole shuffle ------------------------------------------------------------------------


def partition_jobs(out: str, markers: list[dict], partition_bytes: int) -> list[PartitionJob]:
    """The reduce tasks: which rows of which unit's hash file each partition reads."""
    total = sum(m["docs_kept"] for m in markers)
    partitions = partitions_for(total, partition_bytes)
    step = HASH_BUCKETS // partitions
    bounds = list(range(0, len(markers), REWRITE_GROUP)) + [len(markers)]
    jobs = []
    for p in range(partitions):
        sources = []
        for position, m in enumerate(markers):
            cum = np.concatenate([[0], np.cumsum(m["hash_buckets"])])
            lo, hi = int(cum[p * step]), int(cum[(p + 1) * step])
            if hi > lo:
                sources.append((position, fsio.join(out, "hashes", f"{m['unit']}.npy"), lo, hi))
        jobs.append(PartitionJob(out, p, sources, bounds))
    return jobs


def dedup_corpus(out: str, markers: list[dict], c, where: Where) -> tuple[int, int]:
    """Drop every later copy across the corpus (markers: the units' markers in corpus order).
    Returns (documents, bytes) dropped."""
    jobs = partition_jobs(out, markers, c.dedup.partition_bytes)
    bounds = jobs[0].group_bounds
    reduced = sorted(run_units(dedup_partition, jobs, where), key=lambda jr: jr[0].index)
    docs = sum(r["docs"] for _, r in reduced)
    nbytes = sum(r["bytes"] for _, r in reduced)
    rewrites = []
    for g in range(len(bounds) - 1):
        ranges = [
            (drops_path(out, job.index), r["offsets"][g], r["offsets"][g + 1])
            for job, r in reduced
            if r["offsets"][g + 1] > r["offsets"][g]
        ]
        if ranges:
            units = [(i, markers[i]["shards"]) for i in range(bounds[g], bounds[g + 1])]
            rewrites.append(RewriteJob(out, c, units, ranges))
    for _ in run_units(rewrite_group, rewrites, where):
        pass
    return docs, nbytes
