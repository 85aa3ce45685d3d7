"""Exact dedup across the whole corpus: the last step of `codex data clean`.

Each unit already dropped the copies inside itself and wrote its kept documents' hashes to
hashes/UNIT.npy. Here a shuffle in three levels (combine, reduce, rewrite) keeps the first copy of
each text, as one pass over the corpus in order would. Every task reads a bounded number of files,
holds a bounded number of hashes and writes its marker last, so a rerun after a kill runs only the
tasks without one. docs/stages.md, "clean's exact dedup", has the details.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass

import numpy as np

from codex.core import fsio
from codex.core.config import ConfigError
from codex.pipeline.clean.parts import hash_path, rewrite_part
from codex.pipeline.executor import Where, run_units
from codex.pipeline.readers import read_part

log = logging.getLogger("codex.clean")

# A kept document in the shuffle: its 16-byte hash, its byte length and its unit's position in
# corpus order, as four uint64 (a unit's hash file has the first three).
ROW_BYTES = 32
# Hash partitions: the top 16 bits of a hash at most. 65,536 x 256 MB / 32 B holds 5.5e11 kept
# documents; 10 TB of text is about 2e9 documents of 5 KB, 1.5e10 if they averaged 670 bytes.
MAX_PARTITIONS = 1 << 16
# What a combine or reduce task holds, over its rows (ROW_BYTES each): the rows read, their
# concatenation, the sort's index and keys. partition_bytes x this is the stated memory bound.
MEMORY_FACTOR = 3
# How far past a range read an object store's file reads ahead (fsspec's default is 5 MB): a
# reduce reads a small range of each of many files.
RANGE_READAHEAD = 64 << 10
PLAN_VERSION = 2  # the layout of dedup/: a plan of another version starts over


def text_hash(data: bytes) -> bytes:
    """The key exact dedup goes by: 16 bytes of BLAKE2b over a document's normalised UTF-8 text.
    clean's units hash what they keep with it and the rewrites find the rows to drop by it."""
    return hashlib.blake2b(data, digest_size=16).digest()


def partitions_for(total_docs: int, partition_bytes: int) -> int:
    """The smallest power of two P with total_docs * ROW_BYTES / P <= partition_bytes."""
    p = 1
    while total_docs * ROW_BYTES > p * partition_bytes:
        p *= 2
    if p > MAX_PARTITIONS:
        raise ConfigError(
            f"data.clean.dedup.partition_bytes={partition_bytes} would need {p} hash partitions "
            f"for {total_docs} documents (at most {MAX_PARTITIONS}): raise it to at least "
            f"{-(-total_docs * ROW_BYTES // MAX_PARTITIONS)}"
        )
    return p


def ceil_sqrt(n: int) -> int:
    return math.isqrt(n - 1) + 1 if n > 1 else 1


def max_files_read(units: int, docs: int, partition_bytes: int) -> int:
    """The most files one task of the shuffle opens for this corpus: a combine at most
    ceil(sqrt(units)); a reduce one per group, which is ceil(sqrt(units)) groups plus those cut
    by partition_bytes (two neighbours hold more than it); a rewrite one per partition, plus 1."""
    rows = -(-docs * ROW_BYTES // partition_bytes)
    return ceil_sqrt(units) + 2 * rows + 1


def partition_starts(partitions: int) -> np.ndarray:
    """The first hash (its top uint64) of each partition: partitions split the top bits evenly."""
    return np.array([p * (2**64 // partitions) for p in range(partitions)], dtype=np.uint64)


@dataclass(frozen=True)
class Plan:
    """The shuffle's shape: partitions, and the groups of units as [start, end) positions."""

    partitions: int
    groups: list[tuple[int, int]]
    epoch: str  # what the plan was made from: the units' markers and the settings

    @property
    def group_starts(self) -> list[int]:
        return [a for a, _ in self.groups] + [self.groups[-1][1] if self.groups else 0]


def plan_dedup(markers: list[dict], partition_bytes: int) -> Plan:
    """Groups of at most ceil(sqrt(N)) consecutive units holding at most partition_bytes of rows
    (a unit bigger than that is a group alone), and the partitions for their kept documents."""
    total = sum(m["docs_kept"] for m in markers)
    partitions = partitions_for(total, partition_bytes)
    most = ceil_sqrt(len(markers))
    groups: list[tuple[int, int]] = []
    start, size = 0, 0
    for position, m in enumerate(markers):
        rows = m["docs_kept"] * ROW_BYTES
        if position > start and (position - start >= most or size + rows > partition_bytes):
            groups.append((start, position))
            start, size = position, 0
        size += rows
    if markers:
        groups.append((start, len(markers)))
    # strings only, no list per unit: a million new containers would cost the GC seconds
    made_of = hashlib.sha256(f"{PLAN_VERSION} {partition_bytes}".encode())
    for m in markers:
        made_of.update(
            f"|{m['unit']} {m['docs_kept']} {m.get('worker')} {m.get('started')!r} "
            f"{m.get('finished')!r}".encode()
        )
    return Plan(partitions, groups, made_of.hexdigest()[:16])


# --- files: .npy of uint64 rows of 4, the first rows an index of row ranges -------------------


def npy_start(fh) -> tuple[tuple[int, ...], int]:
    """An open .npy file's shape and the byte offset where its data starts."""
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        shape, _, _ = np.lib.format.read_array_header_1_0(fh)
    else:
        shape, _, _ = np.lib.format.read_array_header_2_0(fh)
    return shape, fh.tell()


def read_npy(path: str) -> np.ndarray:
    """A whole 2-D uint64 .npy file (local or gs://)."""
    with fsio.open(path, "rb") as fh:
        return np.lib.format.read_array(fh)


def index_rows(entries: int) -> int:
    """Rows of 4 uint64 that hold an index of `entries` offsets."""
    return (entries + 3) // 4


def write_indexed(path: str, index: np.ndarray, rows: np.ndarray) -> None:
    """An (index_rows(len(index)) + len(rows), 4) uint64 .npy: the index, padded, then the rows;
    written atomically."""
    k = index_rows(len(index))
    head = np.zeros(4 * k, dtype=np.uint64)
    head[: len(index)] = index
    rows = np.ascontiguousarray(rows, dtype=np.uint64).reshape(-1, 4)
    with fsio.atomic_open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": "<u8", "fortran_order": False, "shape": (k + len(rows), 4)}
        )
        fh.write(head.tobytes())
        fh.write(rows.reshape(-1).view(np.uint8).data)  # no copy of what may be 256 MB


def read_indexed(path: str, entries: int, i: int) -> np.ndarray:
    """Rows [index[i], index[i + 1]) of a write_indexed file with `entries` index entries: one
    open, two reads."""
    remote = {"block_size": RANGE_READAHEAD} if fsio.is_remote(path) else {}
    with fsio.open(path, "rb", **remote) as fh:
        _, start = npy_start(fh)
        fh.seek(start + 8 * i)
        lo, hi = (int(x) for x in np.frombuffer(fh.read(16), dtype=np.uint64))
        fh.seek(start + 32 * (index_rows(entries) + lo))
        data = fh.read(32 * (hi - lo))
    return np.frombuffer(data, dtype=np.uint64).reshape(-1, 4)


def _read_all(read, args: list) -> list:
    """read(*a) for every a in args (a[0] a path), in order: 16 at a time from an object store,
    one after another from local files (fsio.request_threads)."""
    return fsio.map_requests(
        lambda a: read(*a), args, fsio.request_threads([a[0] for a in args[:1]])
    )


def _repeats(h0: np.ndarray, h1: np.ndarray) -> np.ndarray:
    """Rows (sorted by hash) whose hash equals the previous row's."""
    repeat = np.zeros(len(h0), dtype=bool)
    repeat[1:] = (h0[1:] == h0[:-1]) & (h1[1:] == h1[:-1])
    return repeat


def dedup_dir(out: str) -> str:
    return fsio.join(out, "dedup")


def _name(kind: str, index: int, ext: str) -> str:
    return f"{kind}-{index:06d}.{ext}"


# --- combine: one group of units ---------------------------------------------------------------


@dataclass
class CombineJob:
    out: str
    index: int
    first: int  # the group's first unit's position in corpus order
    units: list[str]  # the group's units, in corpus order
    partitions: int


def combine_group(job: CombineJob) -> dict:
    """A group's first copies -> firsts-GGGGGG.npy as (h0, h1, bytes, unit) rows sorted by hash,
    indexed by partition; its later copies -> copies-GGGGGG.npy as (unit, h0, h1, bytes) sorted
    by unit; then its marker."""
    folder = dedup_dir(job.out)
    paths = [(hash_path(job.out, u),) for u in job.units]
    pieces = _read_all(read_npy, paths)
    sizes = np.array([len(p) for p in pieces], dtype=np.int64)
    h = np.concatenate(pieces) if pieces else np.zeros((0, 3), dtype=np.uint64)
    del pieces
    # each unit's rows are unique and sorted, and the units in corpus order: a stable sort by
    # hash puts a hash's copies in corpus order
    order = np.lexsort((h[:, 1], h[:, 0]))
    repeat = _repeats(h[order, 0], h[order, 1])
    ends = np.cumsum(sizes)

    def unit_of(rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(ends, rows, side="right").astype(np.uint64) + np.uint64(job.first)

    copies = order[repeat]
    later = np.column_stack([unit_of(copies), h[copies]])
    later = later[np.argsort(later[:, 0], kind="stable")]
    keep = order[~repeat]
    del order, repeat, copies
    kept = h[keep]
    del h
    firsts = np.empty((len(keep), 4), dtype=np.uint64)
    firsts[:, :3] = kept
    del kept
    firsts[:, 3] = unit_of(keep)
    del keep
    index = np.searchsorted(firsts[:, 0], partition_starts(job.partitions))
    index = np.append(index, len(firsts))
    write_indexed(fsio.join(folder, _name("firsts", job.index, "npy")), index, firsts)
    copies_index = np.array([0, len(later)], dtype=np.uint64)
    write_indexed(fsio.join(folder, _name("copies", job.index, "npy")), copies_index, later)
    marker = {"group": job.index, "firsts": len(firsts), "copies": len(later)}
    fsio.write_json(fsio.join(folder, _name("combine", job.index, "json")), marker)
    return marker


# --- reduce: one hash partition ------------------------------------------------------------------


@dataclass
class ReduceJob:
    out: str
    index: int
    partitions: int
    group_starts: list[int]  # unit positions where the groups start, and the end


def reduce_partition(job: ReduceJob) -> dict:
    """Later copies within one hash partition across the groups -> drops-PPPPPP.npy as
    (unit, h0, h1, bytes) rows sorted by unit, indexed by group; then its marker."""
    folder = dedup_dir(job.out)
    groups = len(job.group_starts) - 1
    args = [
        (fsio.join(folder, _name("firsts", g, "npy")), job.partitions + 1, job.index)
        for g in range(groups)
    ]
    pieces = _read_all(read_indexed, args)
    h = np.concatenate(pieces) if pieces else np.zeros((0, 4), dtype=np.uint64)
    del pieces
    # within a group a hash is once, the groups are in corpus order: a stable sort by hash puts
    # the earliest group's copy first
    order = np.lexsort((h[:, 1], h[:, 0]))
    copies = order[_repeats(h[order, 0], h[order, 1])]
    del order
    drops = h[copies][:, [3, 0, 1, 2]]
    del h, copies
    drops = drops[np.argsort(drops[:, 0], kind="stable")]
    index = np.searchsorted(drops[:, 0], np.array(job.group_starts, dtype=np.uint64))
    write_indexed(fsio.join(folder, _name("drops", job.index, "npy")), index, drops)
    marker = {"partition": job.index, "drops": len(drops)}
    fsio.write_json(fsio.join(folder, _name("reduce", job.index, "json")), marker)
    return marker


# --- rewrite: one group of units -------------------------------------------------------------


@dataclass
class RewriteJob:
    out: str
    c: object  # CleanConfig
    index: int
    groups: int
    partitions: int
    first: int  # the group's first unit's position in corpus order
    parts: list[list[str]]  # each unit's parts, in corpus order


def rewrite_group(job: RewriteJob) -> dict:
    """Rewrite the parts of a group of units without their later copies (its copies file and its
    rows of every partition's drops); then its marker, with the documents and bytes dropped."""
    folder = dedup_dir(job.out)
    args = [(fsio.join(folder, _name("copies", job.index, "npy")), 2, 0)]
    args += [
        (fsio.join(folder, _name("drops", p, "npy")), job.groups + 1, job.index)
        for p in range(job.partitions)
    ]
    rows = _read_all(read_indexed, args)
    drops = np.concatenate(rows)
    drops = drops[np.argsort(drops[:, 0], kind="stable")]
    ends = np.arange(job.first, job.first + len(job.parts) + 1, dtype=np.uint64)
    cuts = np.searchsorted(drops[:, 0], ends)
    rewritten = 0
    for k, parts in enumerate(job.parts):
        mine = drops[cuts[k] : cuts[k + 1]]
        if len(mine):
            drop = {row[1:3].tobytes(): int(row[3]) for row in mine}
            rewritten += rewrite_without(job.out, parts, drop, job.c)
    marker = {
        "group": job.index,
        "docs": len(drops),
        "bytes": int(drops[:, 3].sum()),
        "parts": rewritten,
    }
    fsio.write_json(fsio.join(folder, _name("rewrite", job.index, "json")), marker)
    return marker


def rewrite_without(out: str, parts: list[str], drop: dict[bytes, int], c) -> int:
    """Rewrite a unit's parts without the rows whose text hash is in `drop` (idempotent)."""
    rewritten = 0
    for name in parts:
        table = read_part(fsio.join(out, name))
        reasons = [
            "dedup:duplicate" if text_hash(t.encode("utf-8")) in drop else None
            for t in table.column("text").to_pylist()
        ]
        rewritten += rewrite_part(out, name, table, reasons, "dedup", c)
    return rewritten


# --- the whole shuffle ------------------------------------------------------------------------


def _resume(folder: str, plan: Plan) -> set[str]:
    """The names of the markers in dedup/ that this plan may reuse: none when dedup/ was made from
    other units' markers (a unit cleaned again) or by no plan; dedup/ then starts over."""
    path = fsio.join(folder, "plan.json")
    wanted = {"epoch": plan.epoch, "partitions": plan.partitions, "groups": len(plan.groups)}
    if fsio.exists(path) and fsio.read_json(path) == wanted:
        return {fsio.basename(p) for p in fsio.listdir(folder) if p.endswith(".json")}
    fsio.rm(folder, recursive=True)
    fsio.write_json(path, wanted)
    return set()


def _read_markers(paths: list[str]) -> list[dict]:
    return _read_all(fsio.read_json, [(p,) for p in paths])


@dataclass
class Jobs:
    """The shuffle's tasks not done yet, level by level."""

    combine: list[CombineJob]
    reduce: list[ReduceJob]
    rewrite: list[RewriteJob]


def files_read(job: CombineJob | ReduceJob | RewriteJob) -> int:
    """How many files a task opens: a combine its units' hash files, a reduce every group's
    firsts file, a rewrite its copies file and every partition's drops file."""
    if isinstance(job, CombineJob):
        return len(job.units)
    if isinstance(job, ReduceJob):
        return len(job.group_starts) - 1
    return 1 + job.partitions


def dedup_jobs(out: str, markers: list[dict], c, plan: Plan, done: set[str]) -> Jobs:
    """The tasks of the plan whose marker is not in `done`; O(units + groups + partitions)."""
    groups, partitions = len(plan.groups), plan.partitions
    starts = plan.group_starts
    return Jobs(
        [
            CombineJob(out, g, a, [m["unit"] for m in markers[a:b]], partitions)
            for g, (a, b) in enumerate(plan.groups)
            if _name("combine", g, "json") not in done
        ],
        [
            ReduceJob(out, p, partitions, starts)
            for p in range(partitions)
            if _name("reduce", p, "json") not in done
        ],
        [
            RewriteJob(out, c, g, groups, partitions, a, [m["shards"] for m in markers[a:b]])
            for g, (a, b) in enumerate(plan.groups)
            if _name("rewrite", g, "json") not in done
        ],
    )


def dedup_corpus(out: str, markers: list[dict], c, where: Where) -> tuple[int, int]:
    """Drop every later copy across the corpus (markers: the units' markers in corpus order).
    Returns (documents, bytes) dropped."""
    plan = plan_dedup(markers, c.dedup.partition_bytes)
    if not plan.groups:
        return 0, 0
    folder = dedup_dir(out)
    jobs = dedup_jobs(out, markers, c, plan, _resume(folder, plan))
    log.info(
        "clean: dedup of %d units in %d groups and %d hash partitions; to do: %d combine, "
        "%d reduce, %d rewrite tasks",
        len(markers),
        len(plan.groups),
        plan.partitions,
        len(jobs.combine),
        len(jobs.reduce),
        len(jobs.rewrite),
    )
    # each level needs every task of the one before: its marker is the task's last write
    for _ in run_units(combine_group, jobs.combine, where):
        pass
    for _ in run_units(reduce_partition, jobs.reduce, where):
        pass
    results = [r for _, r in run_units(rewrite_group, jobs.rewrite, where)]
    ran = {r["group"] for r in results}
    results += _read_markers(
        [
            fsio.join(folder, _name("rewrite", g, "json"))
            for g in range(len(plan.groups))
            if g not in ran
        ]
    )
    return sum(r["docs"] for r in results), sum(r["bytes"] for r in results)
