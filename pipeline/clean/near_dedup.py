"""URL dedup and MinHash near-dedup across the whole corpus (`data.clean.near_dedup`): the step of
`codex data clean` after the exact dedup (pipeline/clean/dedup.py), a shuffle of the rows every unit
wrote to minhash/UNIT.npy (pipeline/clean/minhash.py): url combine, url reduce, combine, band
reduce, the cluster step (pipeline/clean/near_cluster.py), rewrite.

Every task runs through the executor's run_units, holds about partition_bytes of rows, writes a
marker last (a rerun runs only those without) and decides on sorted arrays, so the local and Ray
runs give the same bytes. Which document of a component is kept is datatrove's rule. The tasks,
the rule, memory and fan-in: docs/stages.md (clean's near-dedup)."""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, replace

import numpy as np

from codex.core import fsio
from codex.core.config import ConfigError
from codex.pipeline.clean.dedup import text_hash
from codex.pipeline.clean.minhash import index_path, signatures_path
from codex.pipeline.clean.near_cluster import (
    PAIR_WIDTH,
    PairFile,
    Steps,
    cluster_pairs,
    marked,
    read_split,
    remove_path,
    write_split,
)
from codex.pipeline.clean.parts import rewrite_part
from codex.pipeline.executor import Where
from codex.pipeline.readers import read_part

log = logging.getLogger("codex.clean")

REWRITE_GROUP = 4  # units per rewrite task
GROUP_ROW = 6 * 8  # a combined row: a unit's 5 columns and the node (unit << 32 | doc)
# Reads in flight inside one task: an object store answers each after tens of milliseconds.
READ_THREADS = 16
# A group's index: row offsets per top 12 bits of the key, the finest reduce partition. 4096
# partitions of partition_bytes (256 MB) hold 2.2e10 signed documents a band, above the 1.5e10
# documents of 10 TB averaging 670 bytes.
GROUP_BITS = 12
GROUP_BINS = 1 << GROUP_BITS
REASONS = ("near_dedup:url", "near_dedup:minhash")  # a drop's reason column: 0, 1
_LOW32 = np.uint64(0xFFFFFFFF)
LOSER = np.uint64(1 << 63)  # set in a combined row's node: a URL loser's (units < 2^31)
PLAN_VERSION = 1  # the layout of near/: a plan of another version starts over
# A task's memory over partition_bytes (its rows, their concatenation, sorts and gathers) and a
# worker's own (Python, numpy, pyarrow): what a near-dedup task reserves on Ray.
MEMORY_FACTOR = 3
WORKER_BYTES = 200 << 20


def check_config(c) -> None:
    """Exit 2 for settings the near-dedup cannot run with (c: CleanConfig)."""
    taken = {"text", "id", "source", "reason"} & set(c.metadata)
    if taken:
        raise ConfigError(
            f"data.clean.metadata names {', '.join(sorted(taken))}: a cleaned part's own column"
        )
    if c.near_dedup.enabled and not c.dedup.enabled:
        raise ConfigError(
            "data.clean.near_dedup.enabled needs data.clean.dedup.enabled: it finds documents by "
            "their exact-dedup hash"
        )


def read_rows(path: str, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of a 2-D .npy file, reading only those bytes (local or gs://)."""
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


def _threads(out: str) -> int:
    """Reads in flight in a task: READ_THREADS on an object store, one after another on a local
    disk (a thread's malloc arena would keep what it freed: a worker's memory would grow task
    by task)."""
    return READ_THREADS if fsio.is_remote(out) else 1


def _save(path: str, rows: np.ndarray) -> None:
    with fsio.atomic_open(path, "wb") as fh:
        np.save(fh, rows)


def _load(path: str, width: int) -> np.ndarray:
    with fsio.open(path, "rb") as fh:
        return np.load(fh).reshape(-1, width)


def partitions_for(rows: int, partition_bytes: int) -> int:
    """The smallest power of two P with rows * 48 / P <= partition_bytes, at most GROUP_BINS."""
    p = 1
    while rows * GROUP_ROW > p * partition_bytes and p < GROUP_BINS:
        p *= 2
    return p


# --- combine: a group of units' blocks in one file ----------------------------------------------


@dataclass
class CombineJob:
    out: str
    group: int
    units: tuple[int, int]  # units [first, end) in corpus order
    blocks: tuple[int, int]  # blocks [first, end): the bands, or (num_buckets, +1) the URLs
    url_parts: int  # the URL reduce's files, whose losers a bands' combine leaves out (0: none)
    n_units: int

    @property
    def kind(self) -> str:
        return "urlgroup" if self.url_parts == 0 and self.blocks[0] > 0 else "group"

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.group:06d}"


def group_path(out: str, group: int, kind: str = "group") -> str:
    return fsio.join(out, "near", f"{kind}-{group:06d}.npy")


def group_index_path(out: str, group: int, kind: str = "group") -> str:
    return fsio.join(out, "near", f"{kind}-{group:06d}-index.npy")


def _rows6(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.uint64) if parts else np.zeros((0, 6), np.uint64)


def _group_losers(job: CombineJob) -> np.ndarray:
    """The URL losers among the group's units, sorted: routed by unit from each URL reduce."""
    if not job.url_parts:
        return np.zeros(0, np.uint64)
    paths = [url_path(job.out, p) for p in range(job.url_parts)]
    got = fsio.map_requests(
        lambda p: read_split(p, job.n_units, *job.units)[:, 0], paths, _threads(job.out)
    )
    return np.sort(np.concatenate(got))


@marked
def combine_group(job: CombineJob) -> dict:
    """One file for a group of units, laid out as a unit's (blocks, each sorted by key, an index
    per top 12 bits), each row with its node (unit << 32 | doc) as a 6th column: a reduce task
    reads one range of each group's file, not of each unit's. A URL loser's band rows have LOSER
    set in the node (routed here by unit from the URL reduces). Holds one block of the group at a
    time. Returns its rows."""
    units = list(range(*job.units))
    losers = _group_losers(job)
    indexes = fsio.map_requests(
        lambda u: _load(index_path(job.out, f"{u:06d}"), 2), units, _threads(job.out)
    )
    blocks = range(*job.blocks)
    total = sum(int(ix[b, -1] - ix[b, 0]) for ix in indexes for b in blocks)
    index = np.zeros((len(blocks), GROUP_BINS + 1), dtype=np.uint64)
    header: dict[str, object] = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint64)),
        "fortran_order": False,
        "shape": (total, 6),
    }
    start = 0
    with fsio.atomic_open(group_path(job.out, job.group, job.kind), "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, header)
        for i, b in enumerate(blocks):

            def read(k: int, b: int = b) -> np.ndarray:
                lo, hi = (int(x) for x in indexes[k][b, [0, -1]])
                rows = read_rows(signatures_path(job.out, f"{units[k]:06d}"), lo, hi)
                node = (np.uint64(units[k]) << np.uint64(32)) | (rows[:, 2] >> np.uint64(32))
                return np.column_stack([rows, node]).astype(np.uint64).reshape(-1, 6)

            block = _rows6(fsio.map_requests(read, range(len(units)), _threads(job.out)))
            if len(losers):
                block[np.isin(block[:, 5], losers), 5] |= LOSER
            block = block[np.lexsort((block[:, 5], block[:, 1], block[:, 0]))]
            top = (block[:, 0] >> np.uint64(64 - GROUP_BITS)).astype(np.int64)
            index[i, 1:] = np.cumsum(np.bincount(top, minlength=GROUP_BINS))
            index[i] += np.uint64(start)
            start += len(block)
            fh.write(block.tobytes())
    _save(group_index_path(job.out, job.group, job.kind), index)
    return {"rows": total}


def plan_groups(markers: list[dict], partition_bytes: int) -> list[tuple[int, int]]:
    """Consecutive units in groups of at most ceil(sqrt(units)), cut earlier where a block of the
    group would hold more than partition_bytes of rows."""
    n = len(markers)
    most = math.isqrt(n - 1) + 1 if n > 1 else 1
    groups, first, rows = [], 0, 0
    for u, m in enumerate(markers):
        mine = max(m["near_dedup"]["signed"], m["near_dedup"]["urls"])
        if u > first and (u - first >= most or (rows + mine) * GROUP_ROW > partition_bytes):
            groups.append((first, u))
            first, rows = u, 0
        rows += mine
    groups.append((first, n))
    return groups


# --- reduce: one hash range of one block (a band, or the URLs) ----------------------------------


@dataclass
class ReduceJob:
    out: str
    groups: int  # the combine's groups are 0 .. groups-1
    block: int  # a band (0 .. num_buckets-1), or num_buckets: the URLs
    part: int
    parts: int
    urls: bool  # the URL block
    n_units: int

    @property
    def name(self) -> str:
        return f"url-{self.part:04d}" if self.urls else f"pairs-{self.block:02d}-{self.part:04d}"


def url_path(out: str, part: int) -> str:
    return fsio.join(out, "near", f"url-{part:04d}.npy")


def pairs_path(out: str, block: int, part: int) -> str:
    return fsio.join(out, "near", f"pairs-{block:02d}-{part:04d}.npy")


def copies_path(out: str, part: int) -> str:
    return fsio.join(out, "near", f"copies-{part:04d}.npy")


def _gather(job: ReduceJob) -> tuple[np.ndarray, np.ndarray]:
    """(rows, node) of this job's hash range from every group: node = unit << 32 | doc."""
    step = GROUP_BINS // job.parts
    kind, row = ("urlgroup", 0) if job.urls else ("group", job.block)

    def read(g: int) -> np.ndarray:
        at = read_rows(group_index_path(job.out, g, kind), row, row + 1)[0]
        lo, hi = int(at[job.part * step]), int(at[(job.part + 1) * step])
        path = group_path(job.out, g, kind)
        return read_rows(path, lo, hi) if hi > lo else np.zeros((0, 6), np.uint64)

    got = _rows6(fsio.map_requests(read, range(job.groups), _threads(job.out)))
    return got[:, :5], got[:, 5]


@marked
def reduce_block(job: ReduceJob) -> dict:
    """URLs: the losers of each URL -> url-PPPP.npy rows (node, hash_a, hash_b, bytes, counted),
    by unit (read_split); counted is 0 for a later copy of a text in its own URL group. A band:
    each document whose band equals an earlier one's is paired with the band's first document in
    corpus order -> pairs-BB-PPPP.npy rows (first's node, hash_a, hash_b, bytes, then the same of
    the other, then the band's key as minhash.band_keys orders it); band 0 also writes the later
    exact copies (copies-PPPP.npy: nodes). Returns the rows written."""
    rows, node = _gather(job)
    nbytes = rows[:, 2] & _LOW32
    if job.urls:
        return _url_losers(job, rows, node, nbytes)
    lost = node >= LOSER  # the URL losers are not in the graph
    if job.block == 0:
        _later_copies(job, rows, node & ~LOSER, lost)
    rows, node, nbytes = rows[~lost], node[~lost], nbytes[~lost]
    order = np.lexsort((node, rows[:, 1], rows[:, 0]))
    rows, node, nbytes = rows[order], node[order], nbytes[order]
    first = np.ones(len(rows), dtype=bool)
    first[1:] = (rows[1:, 0] != rows[:-1, 0]) | (rows[1:, 1] != rows[:-1, 1])
    head = np.maximum.accumulate(np.where(first, np.arange(len(rows)), 0))[~first]
    later = np.flatnonzero(~first)
    pairs = np.column_stack(
        [node[head], rows[head, 3], rows[head, 4], nbytes[head]]
        + [node[later], rows[later, 3], rows[later, 4], nbytes[later]]
        + [rows[head, 1], rows[head, 0]]
    )
    _save(pairs_path(job.out, job.block, job.part), pairs.astype(np.uint64).reshape(-1, PAIR_WIDTH))
    return {"pairs": len(pairs)}


def _later_copies(job: ReduceJob, rows: np.ndarray, node: np.ndarray, lost: np.ndarray) -> None:
    """The documents in the graph that are a later exact copy (same text hash) of another signed
    document: equal texts have equal bands, so they meet in band 0's hash range; the earlier one
    is in the graph too, or a URL loser. The exact dedup drops them; the cluster keeps no such
    copy as a component's survivor."""
    order = np.lexsort((node, rows[:, 4], rows[:, 3], rows[:, 1], rows[:, 0]))
    r = rows[order]
    same = np.zeros(len(r), dtype=bool)
    same[1:] = (r[1:, :2] == r[:-1, :2]).all(axis=1) & (r[1:, 3:5] == r[:-1, 3:5]).all(axis=1)
    later = order[same]
    copies = np.sort(node[later[~lost[later]]])
    _save(copies_path(job.out, job.part), copies.reshape(-1, 1))


def _url_losers(job: ReduceJob, rows: np.ndarray, node: np.ndarray, nbytes: np.ndarray) -> dict:
    # the winner of a URL: longest, then first in corpus order
    order = np.lexsort((node, np.iinfo(np.uint64).max - nbytes, rows[:, 1], rows[:, 0]))
    rows, node, nbytes = rows[order], node[order], nbytes[order]
    first = np.ones(len(rows), dtype=bool)
    first[1:] = (rows[1:, 0] != rows[:-1, 0]) | (rows[1:, 1] != rows[:-1, 1])
    # a later copy of a text within its URL group is the exact dedup's to count
    copy_order = np.lexsort((node, rows[:, 4], rows[:, 3], rows[:, 1], rows[:, 0]))
    r = rows[copy_order]
    copy = np.zeros(len(rows), dtype=bool)
    copy[copy_order[1:]] = (
        (r[1:, 0] == r[:-1, 0])
        & (r[1:, 1] == r[:-1, 1])
        & (r[1:, 3] == r[:-1, 3])
        & (r[1:, 4] == r[:-1, 4])
    )
    lost = ~first
    out = np.column_stack(
        [node[lost], rows[lost, 3], rows[lost, 4], nbytes[lost], (~copy[lost]).astype(np.uint64)]
    )
    out = out.astype(np.uint64).reshape(-1, 5)
    out = out[np.argsort(out[:, 0], kind="stable")]
    unit = (out[:, 0] >> np.uint64(32)).astype(np.int64)
    write_split(url_path(job.out, job.part), out, unit, job.n_units)
    counted = out[:, 4] == 1
    return {
        "url": int(counted.sum()),
        "url_bytes": int(out[counted, 3].sum()),
        "groups": np.unique(unit // REWRITE_GROUP).tolist(),
    }


# --- rewrite: one group of units ---------------------------------------------------------------


@dataclass
class RewriteJob:
    out: str
    c: object  # CleanConfig
    group: int  # units [group * REWRITE_GROUP, +REWRITE_GROUP)
    units: list[tuple[int, list[str]]]  # (position in corpus order, its parts)
    shape: tuple[int, int, int, int]  # URL reduce files, decide files, rewrite groups, units

    @property
    def name(self) -> str:
        return f"rewrite-{self.group:06d}"


@marked
def rewrite_group(job: RewriteJob) -> dict:
    """Rewrite the group's parts without their dropped documents (their rows of every decide's
    remove file, and of every URL reduce's losers); returns parts rewritten."""
    url_parts, decides, groups, n = job.shape
    lo, hi = job.units[0][0], job.units[-1][0] + 1
    got = fsio.map_requests(
        lambda p: read_split(url_path(job.out, p), n, lo, hi), range(url_parts), _threads(job.out)
    )
    urls = np.concatenate(got) if got else np.zeros((0, 5), np.uint64)
    zero = np.zeros(len(urls), np.uint64)
    rows = [np.column_stack([urls[:, 0] >> np.uint64(32), urls[:, 1:3], zero])]
    rows += fsio.map_requests(
        lambda p: read_split(remove_path(job.out, p), groups, job.group),
        range(decides),
        _threads(job.out),
    )
    drops = np.concatenate(rows).astype(np.uint64).reshape(-1, 4)
    drops = drops[np.argsort(drops[:, 0], kind="stable")]
    rewritten = 0
    for position, parts in job.units:
        mine = drops[drops[:, 0] == position]
        if len(mine):
            drop = {row[1:3].tobytes(): REASONS[int(row[3])] for row in mine}
            rewritten += _rewrite_parts(job.out, parts, drop, job.c)
    return {"parts": rewritten}


def _rewrite_parts(out: str, parts: list[str], drop: dict[bytes, str], c) -> int:
    rewritten = 0
    for name in parts:
        table = read_part(fsio.join(out, name))
        reasons = [drop.get(text_hash(t.encode("utf-8"))) for t in table.column("text").to_pylist()]
        rewritten += rewrite_part(out, name, table, reasons, "near", c)
    return rewritten


# --- the whole shuffle --------------------------------------------------------------------------


def plan_epoch(markers: list[dict], nd) -> str:
    """What the near-dedup's files were made from: its settings and the units' markers (a unit
    cleaned again changes it, and the near-dedup then starts over)."""
    made_of = hashlib.sha256(f"{PLAN_VERSION} {nd.partition_bytes} {nd.num_buckets}".encode())
    for m in markers:
        made_of.update(
            f"|{m['unit']} {m['near_dedup']['signed']} {m['near_dedup']['urls']} "
            f"{m.get('worker')} {m.get('started')!r} {m.get('finished')!r}".encode()
        )
    return made_of.hexdigest()[:16]


def _resume(out: str, epoch: str) -> set[str]:
    """The task markers near/ holds for this epoch; near/ starts over for another epoch."""
    folder = fsio.join(out, "near")
    path = fsio.join(folder, "plan.json")
    if fsio.exists(path) and fsio.read_json(path) == {"epoch": epoch}:
        done = fsio.join(folder, "done")
        return {fsio.basename(p) for p in fsio.listdir(done)} if fsio.isdir(done) else set()
    fsio.rm(folder, recursive=True)
    fsio.write_json(path, {"epoch": epoch})
    return set()


def task_memory(partition_bytes: int) -> int:
    """The memory a near-dedup task reserves (Ray's memory=): MEMORY_FACTOR x partition_bytes of
    rows and their sorts, and a worker's own."""
    return MEMORY_FACTOR * partition_bytes + WORKER_BYTES


def near_dedup_corpus(out: str, markers: list[dict], c, where: Where) -> dict:
    """URL dedup then MinHash near-dedup over the corpus (markers: the units' markers in corpus
    order, unit i named i). Each task writes a marker last, so a rerun runs only those without.
    Returns {url, url_bytes, minhash, minhash_bytes, pairs}."""
    nd = c.near_dedup
    assert all(m["unit"] == f"{i:06d}" for i, m in enumerate(markers)), "units named by position"
    signed = sum(m["near_dedup"]["signed"] for m in markers)
    with_url = sum(m["near_dedup"]["urls"] for m in markers)
    n = len(markers)
    memory = max(where.task.memory_bytes, task_memory(nd.partition_bytes))
    steps = Steps(out, replace(where, task=replace(where.task, memory_bytes=memory)), set())
    steps.done = _resume(out, plan_epoch(markers, nd))
    groups = plan_groups(markers, nd.partition_bytes)
    url_parts = partitions_for(with_url, nd.partition_bytes) if with_url else 0
    blocks = (nd.num_buckets, nd.num_buckets + 1)
    jobs = [CombineJob(out, g, units, blocks, 0, n) for g, units in enumerate(groups)]
    steps.run(combine_group, jobs if url_parts else [], results=False)
    url_jobs = [
        ReduceJob(out, len(groups), blocks[0], p, url_parts, True, n) for p in range(url_parts)
    ]
    urls = steps.run(reduce_block, url_jobs)
    jobs = [
        CombineJob(out, g, units, (0, nd.num_buckets), url_parts, n)
        for g, units in enumerate(groups)
    ]
    steps.run(combine_group, jobs, results=False)
    band_parts = partitions_for(signed, nd.partition_bytes)
    band_jobs = [
        ReduceJob(out, len(groups), b, p, band_parts, False, n)
        for b in range(nd.num_buckets)
        for p in range(band_parts)
    ]
    pairs = sum(r["pairs"] for r in steps.run(reduce_block, band_jobs))
    files = [
        PairFile(
            pairs_path(out, j.block, j.part),
            j.block,
            copies_path(out, j.part) if j.block == 0 else "",
        )
        for j in band_jobs
    ]
    rewrite_groups = -(-n // REWRITE_GROUP)
    got = cluster_pairs(steps, files, pairs, nd, (rewrite_groups, REWRITE_GROUP))
    touched = sorted(set(got["groups"]).union(*(u["groups"] for u in urls)))
    shape = (url_parts, got["parts"], rewrite_groups, n)
    rewrites = [
        RewriteJob(
            out,
            c,
            g,
            [
                (i, markers[i]["shards"])
                for i in range(g * REWRITE_GROUP, min(n, (g + 1) * REWRITE_GROUP))
            ],
            shape,
        )
        for g in touched
    ]
    steps.run(rewrite_group, rewrites, results=False)
    url, url_bytes = sum(u["url"] for u in urls), sum(u["url_bytes"] for u in urls)
    log.info(
        "clean: near-dedup: %d signed documents, %d pairs in %d bands x %d partitions, clustered "
        "in %d partitions and %d rounds; dropped %d by URL, %d near-duplicates",
        signed,
        pairs,
        nd.num_buckets,
        band_parts,
        got["parts"],
        got["rounds"],
        url,
        got["minhash"],
    )
    return {
        "url": url,
        "url_bytes": url_bytes,
        "minhash": got["minhash"],
        "minhash_bytes": got["minhash_bytes"],
        "pairs": pairs,
    }


def add_to_stats(stats: dict, got: dict) -> None:
    """Count near_dedup_corpus's drops in the stats (drops near_dedup:url / near_dedup:minhash)."""
    for reason, docs, nbytes in (
        ("url", got["url"], got["url_bytes"]),
        ("minhash", got["minhash"], got["minhash_bytes"]),
    ):
        if docs:
            stats["drops"].setdefault("near_dedup", {})[reason] = docs
            stats["drop_bytes"].setdefault("near_dedup", {})[reason] = nbytes
        stats["drops_total"] += docs
        stats["docs_out"] -= docs
        stats["bytes_out"] -= nbytes
    stats["near_dedup"] = {k: got[k] for k in ("url", "minhash", "pairs")}
