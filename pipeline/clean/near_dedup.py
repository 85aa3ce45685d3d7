"""URL dedup and MinHash near-dedup across the whole corpus (`data.clean.near_dedup`): the step of
`codex data clean` after the exact dedup (pipeline/clean/dedup.py), a shuffle of the rows every unit
wrote to minhash/UNIT.npy (pipeline/clean/minhash.py) in five kinds of task: combine, url reduce,
band reduce, cluster, rewrite.

Every task runs through the executor's run_units and decides on sorted arrays, so the local and Ray
runs give the same bytes. Which document of a component is kept is datatrove's rule. The tasks, the
rule, memory and fan-in: docs/stages.md (clean's near-dedup).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from codex.core import fsio
from codex.core.config import ConfigError
from codex.pipeline.clean.dedup import text_hash
from codex.pipeline.clean.minhash import index_path, signatures_path
from codex.pipeline.clean.parts import rewrite_part
from codex.pipeline.executor import Where, run_units
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
REASONS = ("near_dedup:url", "near_dedup:minhash")  # remove.npy's reason column: 0, 1
_LOW32 = np.uint64(0xFFFFFFFF)


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


# --- reduce: one hash range of one block (a band, or the URLs) ----------------------------------


@dataclass
class CombineJob:
    out: str
    group: int
    units: tuple[int, int]  # units [first, end) in corpus order
    blocks: int  # num_buckets + 1 (the URLs)


def group_path(out: str, group: int) -> str:
    return fsio.join(out, "near", f"group-{group:06d}.npy")


def group_index_path(out: str, group: int) -> str:
    return fsio.join(out, "near", f"group-{group:06d}-index.npy")


def _rows6(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.uint64) if parts else np.zeros((0, 6), np.uint64)


def combine_group(job: CombineJob) -> int:
    """One file for a group of units, laid out as a unit's (blocks, each sorted by key, an index
    per top byte), each row with its node (unit << 32 | doc) as a 6th column: a reduce task reads
    one range of each group's file, not of each unit's. Holds one block of the group at a time.
    Returns its rows."""
    units = list(range(*job.units))
    indexes = fsio.map_requests(
        lambda u: _load(index_path(job.out, f"{u:06d}"), 2), units, READ_THREADS
    )
    total = sum(int(ix[b, -1] - ix[b, 0]) for ix in indexes for b in range(job.blocks))
    index = np.zeros((job.blocks, GROUP_BINS + 1), dtype=np.uint64)
    header: dict[str, object] = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint64)),
        "fortran_order": False,
        "shape": (total, 6),
    }
    start = 0
    with fsio.atomic_open(group_path(job.out, job.group), "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, header)
        for b in range(job.blocks):

            def read(k: int, b: int = b) -> np.ndarray:
                lo, hi = (int(x) for x in indexes[k][b, [0, -1]])
                rows = read_rows(signatures_path(job.out, f"{units[k]:06d}"), lo, hi)
                node = (np.uint64(units[k]) << np.uint64(32)) | (rows[:, 2] >> np.uint64(32))
                return np.column_stack([rows, node]).astype(np.uint64).reshape(-1, 6)

            block = _rows6(fsio.map_requests(read, range(len(units)), READ_THREADS))
            block = block[np.lexsort((block[:, 5], block[:, 1], block[:, 0]))]
            top = (block[:, 0] >> np.uint64(64 - GROUP_BITS)).astype(np.int64)
            index[b, 1:] = np.cumsum(np.bincount(top, minlength=GROUP_BINS))
            index[b] += np.uint64(start)
            start += len(block)
            fh.write(block.tobytes())
    _save(group_index_path(job.out, job.group), index)
    return total


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
    url_files: list[str]  # the URL reduce's outputs (band jobs leave their rows out)


def url_path(out: str, part: int) -> str:
    return fsio.join(out, "near", f"url-{part:04d}.npy")


def pairs_path(out: str, block: int, part: int) -> str:
    return fsio.join(out, "near", f"pairs-{block:02d}-{part:04d}.npy")


def _gather(job: ReduceJob) -> tuple[np.ndarray, np.ndarray]:
    """(rows, node) of this job's hash range from every group: node = unit << 32 | doc."""
    step = GROUP_BINS // job.parts

    def read(g: int) -> np.ndarray:
        at = read_rows(group_index_path(job.out, g), job.block, job.block + 1)[0]
        lo, hi = int(at[job.part * step]), int(at[(job.part + 1) * step])
        return read_rows(group_path(job.out, g), lo, hi) if hi > lo else np.zeros((0, 6), np.uint64)

    got = _rows6(fsio.map_requests(read, range(job.groups), READ_THREADS))
    return got[:, :5], got[:, 5]


# a pair: (node, text_hash_a, text_hash_b, bytes) of a band's first document, then the other's,
# then the band's key (first hash, digest): the cluster's order
PAIR_WIDTH = 10


def reduce_block(job: ReduceJob) -> int:
    """URLs: the losers of each URL -> url-PPPP.npy rows (node, hash_a, hash_b, bytes, counted),
    sorted by node; counted is 0 for a later copy of a text in its own URL group. A band: each
    document whose band equals an earlier one's is paired with the band's first document in corpus
    order -> pairs-BB-PPPP.npy rows (first's node, hash_a, hash_b, bytes, then the same of the
    other, then the band's key as minhash.band_keys orders it). Returns the rows written."""
    rows, node = _gather(job)
    nbytes = rows[:, 2] & _LOW32
    if job.urls:
        return _url_losers(job, rows, node, nbytes)
    if job.url_files:  # the URL losers are not in the graph
        losers = np.concatenate([_load(p, 5)[:, 0] for p in job.url_files])
        keep = ~np.isin(node, losers)
        rows, node, nbytes = rows[keep], node[keep], nbytes[keep]
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
    return len(pairs)


def _url_losers(job: ReduceJob, rows: np.ndarray, node: np.ndarray, nbytes: np.ndarray) -> int:
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
    _save(url_path(job.out, job.part), out)
    return len(out)


# --- cluster: the components of every pair -----------------------------------------------------


@dataclass
class ClusterJob:
    out: str
    pair_files: list[str]
    pair_bands: list[int]  # each pair file's band
    url_files: list[str]
    group_bounds: list[int]  # unit positions where rewrite groups start (and the end)


def remove_path(out: str) -> str:
    return fsio.join(out, "near", "remove.npy")


def _components(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """Each of n nodes' smallest node index in its component (edges a-b, indices into 0..n-1)."""
    label = np.arange(n, dtype=np.int64)
    while True:
        low = np.minimum(label[a], label[b])
        before = label.copy()
        np.minimum.at(label, a, low)
        np.minimum.at(label, b, low)
        while True:  # pointer jumping: every node straight to its label's label
            jumped = label[label]
            if np.array_equal(jumped, label):
                break
            label = jumped
        if np.array_equal(label, before):
            return label


def roots(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """Each of n nodes' root under datatrove's MinhashDedupCluster, which unions the edges a-b
    (indices into 0..n-1, a < b) in the order given: union by size, a's set winning a tie.

    A component of two nodes has one edge (maybe repeated): its root is its first node. Only the
    edges of bigger components go through the union-find, each edge once, at its first occurrence
    (a repeated edge joins nothing). That loop is Python, as datatrove's is."""
    label = _components(a, b, n)
    root = label.copy()
    in_big = np.bincount(label, minlength=n)[label] > 2
    big = in_big[a]
    if not big.any():
        return root
    a, b = a[big], b[big]
    _, first = np.unique(np.column_stack([a, b]), axis=0, return_index=True)
    first.sort()
    parent: dict[int, int] = {}
    size: dict[int, int] = {}

    def find(x: int) -> int:
        while (p := parent.get(x, x)) != x:
            g = parent.get(p, p)
            parent[x] = g  # path halving: the roots stay the same
            x = g
        return x

    for x, y in zip(a[first].tolist(), b[first].tolist(), strict=True):
        rx, ry = find(x), find(y)
        if rx != ry:
            sx, sy = size.get(rx, 1), size.get(ry, 1)
            if sx < sy:
                rx, ry = ry, rx
            parent[ry] = rx
            size[rx] = sx + sy
    inside = np.flatnonzero(in_big)
    root[inside] = [find(x) for x in inside.tolist()]
    return root


def cluster(job: ClusterJob) -> dict:
    """near/remove.npy: rows (unit, hash_a, hash_b, reason) sorted by unit (reason: REASONS'
    index); returns the counts and bytes per reason and each rewrite group's row offsets."""
    pairs = [_load(p, PAIR_WIDTH) for p in job.pair_files]
    band = np.concatenate(
        [np.full(len(p), b, np.uint64) for p, b in zip(pairs, job.pair_bands, strict=True)]
        or [np.zeros(0, np.uint64)]
    )
    edges = np.concatenate(pairs) if pairs else np.zeros((0, PAIR_WIDTH), np.uint64)
    del pairs
    # datatrove's order: band by band, a band's signatures by key, a signature's documents in
    # corpus order (the first document is the same for all of a signature's pairs)
    edges = edges[np.lexsort((edges[:, 4], edges[:, 9], edges[:, 8], band))]
    del band
    urls = [_load(p, 5) for p in job.url_files]
    losers = np.concatenate(urls) if urls else np.zeros((0, 5), np.uint64)
    del urls
    ends = np.concatenate([edges[:, :4], edges[:, 4:8]])  # (node, hash_a, hash_b, bytes)
    del edges
    nodes, first, inverse = np.unique(ends[:, 0], return_index=True, return_inverse=True)
    attrs = ends[first, 1:]
    half = len(ends) // 2
    root = roots(inverse[:half], inverse[half:], len(nodes))
    del ends, inverse
    # a later exact copy (an earlier node or URL loser with the same text hash) is the exact
    # dedup's; a component keeps its first other node (nodes are sorted: corpus order)
    keys = np.concatenate([nodes, losers[:, 0]])
    hashes = np.concatenate([attrs[:, :2], losers[:, 1:3]])
    order = np.lexsort((keys, hashes[:, 1], hashes[:, 0]))
    h = hashes[order]
    later_copy = np.zeros(len(keys), dtype=bool)
    later_copy[order[1:]] = (h[1:, 0] == h[:-1, 0]) & (h[1:, 1] == h[:-1, 1])
    keepers = np.flatnonzero(~later_copy[: len(nodes)])
    # each component keeps its root, or where the exact dedup drops it, its first keeper
    order = np.lexsort((keepers, keepers != root[keepers], root[keepers]))
    ks, kl = keepers[order], root[keepers][order]
    root = np.ones(len(ks), dtype=bool)
    root[1:] = kl[1:] != kl[:-1]
    gone = ks[~root]
    removed_near = np.column_stack(
        [
            nodes[gone] >> np.uint64(32),
            attrs[gone, 0],
            attrs[gone, 1],
            np.ones(len(gone), np.uint64),
        ]
    ).astype(np.uint64)
    near_bytes = int(attrs[gone, 2].sum())
    removed_url = np.column_stack(
        [
            losers[:, 0] >> np.uint64(32),
            losers[:, 1],
            losers[:, 2],
            np.zeros(len(losers), np.uint64),
        ]
    ).astype(np.uint64)
    rows = np.concatenate([removed_url.reshape(-1, 4), removed_near.reshape(-1, 4)])
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    _save(remove_path(job.out), rows)
    counted = losers[:, 4] == 1
    return {
        "url": int(counted.sum()),
        "url_bytes": int(losers[counted, 3].sum()),
        "minhash": len(removed_near),
        "minhash_bytes": near_bytes,
        "pairs": half,
        "offsets": np.searchsorted(rows[:, 0], np.array(job.group_bounds, np.uint64)).tolist(),
    }


# --- rewrite: one group of units ---------------------------------------------------------------


@dataclass
class RewriteJob:
    out: str
    c: object  # CleanConfig
    units: list[tuple[int, list[str]]]  # (position in corpus order, its parts)
    lo: int  # rows [lo, hi) of near/remove.npy are these units'
    hi: int


def rewrite_group(job: RewriteJob) -> int:
    """Rewrite the group's parts without their dropped documents; returns parts rewritten."""
    rows = read_rows(remove_path(job.out), job.lo, job.hi)
    rewritten = 0
    for position, parts in job.units:
        mine = rows[rows[:, 0] == position]
        if len(mine):
            drop = {row[1:3].tobytes(): REASONS[int(row[3])] for row in mine}
            rewritten += _rewrite_parts(job.out, parts, drop, job.c)
    return rewritten


def _rewrite_parts(out: str, parts: list[str], drop: dict[bytes, str], c) -> int:
    rewritten = 0
    for name in parts:
        table = read_part(fsio.join(out, name))
        reasons = [drop.get(text_hash(t.encode("utf-8"))) for t in table.column("text").to_pylist()]
        rewritten += rewrite_part(out, name, table, reasons, "near", c)
    return rewritten


# --- the whole shuffle --------------------------------------------------------------------------


def near_dedup_corpus(out: str, markers: list[dict], c, where: Where) -> dict:
    """URL dedup then MinHash near-dedup over the corpus (markers: the units' markers in corpus
    order, unit i named i). Returns {url, url_bytes, minhash, minhash_bytes, pairs}."""
    nd = c.near_dedup
    assert all(m["unit"] == f"{i:06d}" for i, m in enumerate(markers)), "units named by position"
    signed = sum(m["near_dedup"]["signed"] for m in markers)
    with_url = sum(m["near_dedup"]["urls"] for m in markers)
    n = len(markers)
    groups = plan_groups(markers, nd.partition_bytes)
    combines = [CombineJob(out, g, units, nd.num_buckets + 1) for g, units in enumerate(groups)]
    for _ in run_units(combine_group, combines, where):
        pass
    url_parts = partitions_for(with_url, nd.partition_bytes)
    # the URL block is the last one of each file
    url_jobs = [
        ReduceJob(out, len(groups), nd.num_buckets, p, url_parts, True, [])
        for p in range(url_parts if with_url else 0)
    ]
    url_files = [url_path(out, j.part) for j in url_jobs]
    for _ in run_units(_reduce, url_jobs, where):
        pass
    band_parts = partitions_for(signed, nd.partition_bytes)
    band_jobs = [
        ReduceJob(out, len(groups), b, p, band_parts, False, url_files)
        for b in range(nd.num_buckets)
        for p in range(band_parts)
    ]
    pairs = sum(r for _, r in run_units(_reduce, band_jobs, where))
    bounds = list(range(0, n, REWRITE_GROUP)) + [n]
    files = [pairs_path(out, j.block, j.part) for j in band_jobs]
    bands = [j.block for j in band_jobs]
    job = ClusterJob(out, files, bands, url_files, bounds)
    [(_, got)] = list(run_units(cluster, [job], where))
    rewrites = []
    for g in range(len(bounds) - 1):
        lo, hi = got["offsets"][g], got["offsets"][g + 1]
        if hi > lo:
            units = [(i, markers[i]["shards"]) for i in range(bounds[g], bounds[g + 1])]
            rewrites.append(RewriteJob(out, c, units, lo, hi))
    for _ in run_units(rewrite_group, rewrites, where):
        pass
    log.info(
        "clean: near-dedup: %d signed documents, %d pairs in %d bands x %d partitions; dropped %d "
        "by URL, %d near-duplicates",
        signed,
        pairs,
        nd.num_buckets,
        band_parts,
        got["url"],
        got["minhash"],
    )
    got.pop("offsets")
    return got


def _reduce(job: ReduceJob) -> int:
    return reduce_block(job)


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
