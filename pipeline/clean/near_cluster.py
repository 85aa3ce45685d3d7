"""near-dedup's cluster step in bounded memory: the band reduces' pairs to the documents each
component drops, as datatrove's MinhashDedupCluster would, in tasks over hash partitions of nodes
(a node: unit << 32 | doc), each holding about partition_bytes of rows.

scatter (a pair file to edges, pairs and exact-copy flags by node), connected components in rounds
of large-star and small-star (Kiveris et al. 2014) until a round changes nothing, join (each pair
and flag to its component's label, the component's smallest node), decide (a component's
union-find roots in datatrove's order, and the documents it drops). docs/stages.md has the details.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from codex.core import fsio
from codex.pipeline.clean.dedup import npy_start
from codex.pipeline.executor import Where, run_units

# a pair: (node, text_hash_a, text_hash_b, bytes) of a band's first document, then the other's,
# then the band's key (first hash, digest): the cluster's order
PAIR_WIDTH = 10
# A task's rows, per pair: the pair with its band and label (12 uint64), which a decide holds with
# its two ends and their sort. partition_bytes / CLUSTER_ROW pairs a partition.
CLUSTER_ROW = 96
MAX_PARTITIONS = 1 << 16
MAX_ROUNDS = 64  # large-star and small-star converge in O(log^2 n) rounds
RANGE_READAHEAD = 64 << 10
_U = np.uint64


def partitions_for(pairs: int, partition_bytes: int) -> int:
    """The smallest power of two P with pairs * CLUSTER_ROW / P <= partition_bytes."""
    p = 1
    while pairs * CLUSTER_ROW > p * partition_bytes and p < MAX_PARTITIONS:
        p *= 2
    return p


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a node's uniform 64-bit hash (partitions, fingerprints)."""
    with np.errstate(over="ignore"):
        z = x.astype(_U) + _U(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U(30))) * _U(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U(27))) * _U(0x94D049BB133111EB)
    return z ^ (z >> _U(31))


def part_of(x: np.ndarray, parts: int) -> np.ndarray:
    """Each node's partition of `parts` (a power of two): the top bits of its mix."""
    if parts == 1:
        return np.zeros(len(x), np.int64)
    return (mix(x) >> _U(64 - (parts.bit_length() - 1))).astype(np.int64)


# --- a marker per task ---------------------------------------------------------------------------


def done_path(out: str, name: str) -> str:
    return fsio.join(out, "near", "done", f"{name}.json")


def marked(fn: Callable[[Any], dict]) -> Callable[[Any], dict]:
    """fn(job), then its result as the job's marker (near/done/NAME.json), the task's last write:
    a rerun skips the tasks with one (Steps.run)."""

    @functools.wraps(fn)
    def run(job):
        got = fn(job)
        fsio.write_json(done_path(job.out, job.name), got)
        return got

    return run


@dataclass
class Steps:
    """Runs a step's tasks that have no marker yet (`done`: the marker names found when the
    near-dedup started) through the executor, each task's memory reserved (where.task)."""

    out: str
    where: Where
    done: set[str]

    def run(self, fn: Callable[[Any], dict], jobs: Sequence, results: bool = True) -> list[dict]:
        """Every job's marker, in the jobs' order (results=False: none, nothing read)."""
        todo = [j for j in jobs if f"{j.name}.json" not in self.done]
        got = {j.name: r for j, r in run_units(fn, todo, self.where)}
        if not results:
            return []
        left = [j.name for j in jobs if j.name not in got]
        paths = [done_path(self.out, n) for n in left]
        read = fsio.map_requests(fsio.read_json, paths, fsio.request_threads(paths))
        got.update(zip(left, read, strict=True))
        return [got[j.name] for j in jobs]


# --- files of rows split into parts, an index first --------------------------------------------


def _index_rows(entries: int, width: int) -> int:
    return -(-entries // width)


def write_split(path: str, rows: np.ndarray, part: np.ndarray, parts: int) -> None:
    """An .npy of uint64 rows of rows.shape[1]: the (parts + 1) offsets of each part's rows
    (padded to whole rows), then the rows, part by part (in their order within a part)."""
    rows = np.asarray(rows, np.uint64)
    width = rows.shape[1]
    order = np.argsort(part, kind="stable")
    rows = rows[order]
    index = np.searchsorted(part[order], np.arange(parts + 1)).astype(np.uint64)
    k = _index_rows(parts + 1, width)
    head = np.zeros(k * width, np.uint64)
    head[: parts + 1] = index
    with fsio.atomic_open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": "<u8", "fortran_order": False, "shape": (k + len(rows), width)}
        )
        fh.write(head.tobytes())
        fh.write(np.ascontiguousarray(rows).reshape(-1).view(np.uint8).data)


def read_split(path: str, parts: int, lo: int, hi: int | None = None) -> np.ndarray:
    """Parts [lo, hi) (hi: lo + 1) of a write_split file of `parts` parts: one open, three reads."""
    hi = lo + 1 if hi is None else hi
    remote = {"block_size": RANGE_READAHEAD} if fsio.is_remote(path) else {}
    with fsio.open(path, "rb", **remote) as fh:
        shape, start = npy_start(fh)
        width = shape[1]
        fh.seek(start + 8 * lo)
        a = int(np.frombuffer(fh.read(8), np.uint64)[0])
        fh.seek(start + 8 * hi)
        b = int(np.frombuffer(fh.read(8), np.uint64)[0])
        if b <= a:
            return np.zeros((0, width), np.uint64)
        fh.seek(start + 8 * width * (_index_rows(parts + 1, width) + a))
        data = fh.read(8 * width * (b - a))
    return np.frombuffer(data, np.uint64).reshape(-1, width)


def gather(paths: list[str], parts: int, part: int, width: int) -> np.ndarray:
    """Part `part` of every write_split file in `paths`, concatenated in their order."""
    got = fsio.map_requests(
        lambda p: read_split(p, parts, part), paths, fsio.request_threads(paths)
    )
    return np.concatenate(got) if got else np.zeros((0, width), np.uint64)


def cluster_path(out: str, kind: str, i: int, r: int = 0) -> str:
    return fsio.join(out, "near", "cluster", f"{kind}-{r:03d}-{i:06d}.npy")


def _unique_rows(rows: np.ndarray) -> np.ndarray:
    """Rows of 2 sorted by (first, second), each once."""
    order = np.lexsort((rows[:, 1], rows[:, 0]))
    rows = rows[order]
    keep = np.ones(len(rows), bool)
    keep[1:] = (rows[1:, 0] != rows[:-1, 0]) | (rows[1:, 1] != rows[:-1, 1])
    return rows[keep]


def fingerprint(rows: np.ndarray) -> int:
    """An order-free fingerprint of a set of distinct edges (rows of 2)."""
    with np.errstate(over="ignore"):
        h = mix(mix(rows[:, 0]) ^ rows[:, 1])
    return int(h.sum(dtype=np.uint64))


# --- scatter: one pair file ---------------------------------------------------------------------


@dataclass
class ScatterJob:
    out: str
    index: int
    pairs: str  # a band reduce's pair file
    band: int
    copies: str  # band 0's later exact copies (nodes), or ""
    parts: int

    @property
    def name(self) -> str:
        return f"scatter-{self.index:06d}"


@marked
def scatter(job: ScatterJob) -> dict:
    """A pair file -> its edges both ways (by the first node's partition: the first round's
    input), its pairs with their band (by the first document's partition: the join's) and, of
    band 0, the later exact copies (by node)."""
    with fsio.open(job.pairs, "rb") as fh:
        pairs = np.load(fh).reshape(-1, PAIR_WIDTH)
    a, b = pairs[:, 0], pairs[:, 4]
    edges = _unique_rows(np.concatenate([np.column_stack([a, b]), np.column_stack([b, a])]))
    write_split(
        cluster_path(job.out, "edges", job.index), edges, part_of(edges[:, 0], job.parts), job.parts
    )
    del edges
    rows = np.column_stack([pairs, np.full(len(pairs), job.band, np.uint64)])
    del pairs
    write_split(cluster_path(job.out, "pairs", job.index), rows, part_of(a, job.parts), job.parts)
    copies = np.zeros((0, 1), np.uint64)
    if job.copies:
        with fsio.open(job.copies, "rb") as fh:
            copies = np.load(fh).reshape(-1, 1)
    write_split(
        cluster_path(job.out, "copies", job.index),
        copies,
        part_of(copies[:, 0], job.parts),
        job.parts,
    )
    return {"pairs": len(rows)}


# --- connected components: rounds of large-star and small-star ---------------------------------


@dataclass
class StarJob:
    out: str
    kind: str  # "large" or "small"
    round: int
    part: int
    parts: int
    source: tuple[str, int, int]  # the input files: their kind, round and count

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.round:03d}-{self.part:06d}"


def _inputs(job: StarJob) -> np.ndarray:
    kind, r, count = job.source
    paths = [cluster_path(job.out, kind, i, r) for i in range(count)]
    return _unique_rows(gather(paths, job.parts, job.part, 2))


@marked
def star(job: StarJob) -> dict:
    """One partition of a large-star or small-star step over edges (u, v) held by u's partition.

    large: m(u) = the least of u and its neighbours; (v, m(u)) for each neighbour v > u, held by
    v's partition (small-star's). Its input's fingerprint (each edge once, the way u < v) tells
    the driver a round that changed nothing: the edges are then stars around each component's
    least node, and this step's output is each node's label, by node.
    small: the input is each edge once, by its larger node u; m = u's least neighbour; (v, m) for
    each neighbour v and (u, m), both ways, each by its first node's partition."""
    e = _inputs(job)
    u, v = e[:, 0], e[:, 1]
    first = np.ones(len(e), bool)
    first[1:] = u[1:] != u[:-1]
    at = np.maximum.accumulate(np.where(first, np.arange(len(e)), 0))
    least = v[at]  # each u's least neighbour (sorted by u, then v)
    if job.kind == "large":
        fp = fingerprint(e[u < v])
        m = np.minimum(u, least)
        up = v > u
        out = np.column_stack([v[up], m[up]])
        write_split(
            cluster_path(job.out, "large", job.part, job.round),
            out,
            part_of(out[:, 0], job.parts),
            job.parts,
        )
        return {"fingerprint": fp, "edges": int((u < v).sum())}
    m = least
    leaf = v != m
    pairs = np.concatenate(
        [np.column_stack([v[leaf], m[leaf]]), np.column_stack([u[first], m[first]])]
    )
    both = _unique_rows(np.concatenate([pairs, pairs[:, ::-1]]))
    write_split(
        cluster_path(job.out, "small", job.part, job.round),
        both,
        part_of(both[:, 0], job.parts),
        job.parts,
    )
    return {"edges": len(both) // 2}


# --- join: pairs and copies to their component's label -----------------------------------------


@dataclass
class JoinJob:
    out: str
    part: int
    parts: int
    scattered: int  # scatter tasks
    final: int  # the round whose large-star output is the labels

    @property
    def name(self) -> str:
        return f"join-{self.part:06d}"


def _label(nodes: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Each node's label (labels: rows (node, label) sorted by node; a node not there is one)."""
    at = np.searchsorted(labels[:, 0], nodes)
    at = np.minimum(at, max(len(labels) - 1, 0))
    if not len(labels):
        return nodes.copy()
    found = labels[at, 0] == nodes
    return np.where(found, labels[at, 1], nodes)


@marked
def join(job: JoinJob) -> dict:
    """This node partition's pairs (by their first document) and later exact copies, each with
    its component's label, by the label's partition (the decide's)."""
    labels = gather(
        [cluster_path(job.out, "large", i, job.final) for i in range(job.parts)],
        job.parts,
        job.part,
        2,
    )
    labels = labels[np.argsort(labels[:, 0], kind="stable")]
    paths = [cluster_path(job.out, "pairs", i) for i in range(job.scattered)]
    pairs = gather(paths, job.parts, job.part, PAIR_WIDTH + 1)
    label = _label(pairs[:, 0], labels)
    rows = np.column_stack([pairs, label])
    del pairs
    write_split(
        cluster_path(job.out, "joined", job.part), rows, part_of(label, job.parts), job.parts
    )
    del rows
    paths = [cluster_path(job.out, "copies", i) for i in range(job.scattered)]
    copies = gather(paths, job.parts, job.part, 1)[:, 0]
    label = _label(copies, labels)
    write_split(
        cluster_path(job.out, "flags", job.part),
        np.column_stack([copies, label]),
        part_of(label, job.parts),
        job.parts,
    )
    return {"labels": len(labels)}


# --- decide: the components of one label partition ---------------------------------------------


@dataclass
class DecideJob:
    out: str
    part: int
    parts: int
    groups: int  # rewrite groups
    group_units: int  # units a rewrite group
    whole: list[PairFile] | None = None  # one partition: the band reduces' files, read here

    @property
    def name(self) -> str:
        return f"decide-{self.part:06d}"


def remove_path(out: str, part: int) -> str:
    return fsio.join(out, "near", f"remove-{part:06d}.npy")


@marked
def decide(job: DecideJob) -> dict:
    """The documents this partition's components drop -> remove-PPPPPP.npy: rows (unit, hash_a,
    hash_b, 1) by rewrite group. A component's pairs are replayed in datatrove's order (roots),
    and it keeps its root, or where the exact dedup drops that (a later exact copy), its first
    document the exact dedup keeps. Returns the drops, their bytes and the groups they are in."""
    if job.whole is not None:  # every pair fits one task: no scatter, rounds or join
        edges, copies = _whole(job.whole)
    else:
        paths = [cluster_path(job.out, "joined", i) for i in range(job.parts)]
        edges = gather(paths, job.parts, job.part, PAIR_WIDTH + 2)
        paths = [cluster_path(job.out, "flags", i) for i in range(job.parts)]
        copies = gather(paths, job.parts, job.part, 2)[:, 0]
    # datatrove's order: band by band, a band's signatures by key, a signature's documents in
    # corpus order (the first document is the same for all of a signature's pairs)
    edges = edges[np.lexsort((edges[:, 4], edges[:, 9], edges[:, 8], edges[:, PAIR_WIDTH]))]
    ends = np.concatenate([edges[:, :4], edges[:, 4:8]])  # (node, hash_a, hash_b, bytes)
    del edges
    nodes, first, inverse = np.unique(ends[:, 0], return_index=True, return_inverse=True)
    attrs = ends[first, 1:]
    half = len(ends) // 2
    root = roots(inverse[:half], inverse[half:], len(nodes))
    del ends, inverse
    keepers = np.flatnonzero(~np.isin(nodes, copies))
    # each component keeps its root, or where the exact dedup drops it, its first keeper
    order = np.lexsort((keepers, keepers != root[keepers], root[keepers]))
    ks, kl = keepers[order], root[keepers][order]
    head = np.ones(len(ks), dtype=bool)
    head[1:] = kl[1:] != kl[:-1]
    gone = np.sort(ks[~head])
    unit = nodes[gone] >> _U(32)
    rows = np.column_stack([unit, attrs[gone, 0], attrs[gone, 1], np.ones(len(gone), _U)])
    group = (unit // _U(job.group_units)).astype(np.int64)
    write_split(remove_path(job.out, job.part), rows.reshape(-1, 4), group, job.groups)
    return {
        "minhash": len(gone),
        "minhash_bytes": int(attrs[gone, 2].sum()),
        "groups": np.unique(group).tolist(),
    }


def _whole(files: list[PairFile]) -> tuple[np.ndarray, np.ndarray]:
    """Every pair with its band (and a label column, unused), and every later exact copy."""

    def load(path: str, width: int) -> np.ndarray:
        with fsio.open(path, "rb") as fh:
            return np.load(fh).reshape(-1, width)

    threads = fsio.request_threads([f.path for f in files])
    pairs = fsio.map_requests(lambda f: load(f.path, PAIR_WIDTH), files, threads)
    edges = np.zeros((sum(len(p) for p in pairs), PAIR_WIDTH + 2), np.uint64)
    at = 0
    for p, f in zip(pairs, files, strict=True):
        edges[at : at + len(p), :PAIR_WIDTH] = p
        edges[at : at + len(p), PAIR_WIDTH] = f.band
        at += len(p)
    copies = [load(f.copies, 1)[:, 0] for f in files if f.copies]
    return edges, np.concatenate(copies) if copies else np.zeros(0, np.uint64)


# --- datatrove's union-find roots ---------------------------------------------------------------


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


# --- the whole cluster step ---------------------------------------------------------------------


@dataclass
class PairFile:
    path: str
    band: int
    copies: str  # band 0's later exact copies of this hash range, or ""


def cluster_pairs(
    steps: Steps, files: list[PairFile], pairs: int, c, groups: tuple[int, int]
) -> dict:
    """The drops of every component of the pairs in `files` (pairs in all), in tasks of about
    c.partition_bytes (c: NearDedupConfig) -> remove-PPPPPP.npy by rewrite group (`groups`: how
    many, and units a group). Returns the drops, their bytes, the groups with drops, the rounds."""
    out, parts = steps.out, partitions_for(pairs, c.partition_bytes)
    if parts == 1:
        [one] = steps.run(decide, [DecideJob(out, 0, 1, *groups, whole=files)])
        return {**one, "parts": 1, "rounds": 0}
    jobs = [ScatterJob(out, i, f.path, f.band, f.copies, parts) for i, f in enumerate(files)]
    steps.run(scatter, jobs, results=False)
    source, before, final = ("edges", 0, len(jobs)), None, -1
    for r in range(MAX_ROUNDS):
        large = [StarJob(out, "large", r, p, parts, source) for p in range(parts)]
        ends = steps.run(star, large)
        now = (sum(g["fingerprint"] for g in ends) % (1 << 64), sum(g["edges"] for g in ends))
        if now == before:  # the round before changed nothing: stars, and large-star's labels
            final = r
            break
        before = now
        small = [StarJob(out, "small", r, p, parts, ("large", r, parts)) for p in range(parts)]
        steps.run(star, small, results=False)
        source = ("small", r, parts)
    if final < 0:
        raise RuntimeError(f"near-dedup: components not found in {MAX_ROUNDS} rounds")
    steps.run(join, [JoinJob(out, p, parts, len(jobs), final) for p in range(parts)], False)
    got = steps.run(decide, [DecideJob(out, p, parts, *groups) for p in range(parts)])
    return {
        "minhash": sum(g["minhash"] for g in got),
        "minhash_bytes": sum(g["minhash_bytes"] for g in got),
        "groups": sorted({x for g in got for x in g["groups"]}),
        "parts": parts,
        "rounds": final,
    }
