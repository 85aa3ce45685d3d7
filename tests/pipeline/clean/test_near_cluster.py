"""near-dedup's cluster step in partitions (pipeline/clean/near_cluster.py): the same drops as one
task holding every pair, each task's memory bounded by partition_bytes, a failed task redone alone
by a rerun. The pairs are bench/bench_near_dedup_memory.py's synthetic ones."""

from __future__ import annotations

import importlib.util
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from codex.core.config.data import NearDedupConfig
from codex.pipeline.clean import near_cluster as C
from codex.pipeline.executor import Where

_spec = importlib.util.spec_from_file_location(
    "bench_near_dedup_memory",
    Path(__file__).resolve().parents[3] / "bench" / "bench_near_dedup_memory.py",
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def reference(folder: Path) -> np.ndarray:
    """The drops as the near-dedup took them in one task holding every pair (its cluster step
    before partitions, without URL losers): rows (unit, hash_a, hash_b, 1), sorted."""
    files = bench.pair_files(folder, 2)
    pairs = [np.load(f.path).reshape(-1, C.PAIR_WIDTH) for f in files]
    band = np.concatenate(
        [np.full(len(p), f.band, np.uint64) for p, f in zip(pairs, files, strict=True)]
    )
    edges = np.concatenate(pairs)
    edges = edges[np.lexsort((edges[:, 4], edges[:, 9], edges[:, 8], band))]
    ends = np.concatenate([edges[:, :4], edges[:, 4:8]])
    nodes, first, inverse = np.unique(ends[:, 0], return_index=True, return_inverse=True)
    attrs = ends[first, 1:]
    half = len(ends) // 2
    root = C.roots(inverse[:half], inverse[half:], len(nodes))
    order = np.lexsort((nodes, attrs[:, 1], attrs[:, 0]))
    h = attrs[order]
    later_copy = np.zeros(len(nodes), dtype=bool)
    later_copy[order[1:]] = (h[1:, 0] == h[:-1, 0]) & (h[1:, 1] == h[:-1, 1])
    keepers = np.flatnonzero(~later_copy)
    order = np.lexsort((keepers, keepers != root[keepers], root[keepers]))
    ks, kl = keepers[order], root[keepers][order]
    head = np.ones(len(ks), dtype=bool)
    head[1:] = kl[1:] != kl[:-1]
    gone = ks[~head]
    rows = np.column_stack(
        [
            nodes[gone] >> np.uint64(32),
            attrs[gone, 0],
            attrs[gone, 1],
            np.ones(len(gone), np.uint64),
        ]
    )
    return rows[np.lexsort(rows.T[::-1])]


def clustered(folder: Path, got: dict, units: int) -> np.ndarray:
    groups = -(-units // 4)
    rows = [
        C.read_split(C.remove_path(str(folder), p), groups, 0, groups) for p in range(got["parts"])
    ]
    rows = np.concatenate(rows)
    return rows[np.lexsort(rows.T[::-1])]


def run_cluster(
    folder: Path, made: dict, partition_bytes: int, done: frozenset = frozenset()
) -> dict:
    steps = C.Steps(str(folder), Where(), set(done))
    nd = NearDedupConfig(partition_bytes=partition_bytes)
    groups = -(-made["units"] // 4)
    return C.cluster_pairs(steps, bench.pair_files(folder, 2), made["pairs"], nd, (groups, 4))


def measured(fn, peaks: dict):
    """fn, each call's peak of traced memory above what was held before it kept in peaks."""

    def run(job):
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        got = fn(job)
        peaks[job.name] = tracemalloc.get_traced_memory()[1] - before
        return got

    return run


def check(tmp_path: Path, pairs: int, partition_bytes: int, monkeypatch) -> None:
    made = bench.write_pairs(tmp_path, bench.nodes_for(pairs), seed=3, band_parts=2)
    peaks: dict[str, int] = {}
    for name in ("scatter", "star", "join", "decide"):
        monkeypatch.setattr(C, name, measured(getattr(C, name), peaks))
    tracemalloc.start()
    try:
        got = run_cluster(tmp_path, made, partition_bytes)
    finally:
        tracemalloc.stop()
    assert got["parts"] >= 8 and got["rounds"] >= 1
    want = reference(tmp_path)
    assert len(want) > pairs // 20
    assert np.array_equal(clustered(tmp_path, got, made["units"]), want)
    assert got["minhash"] == len(want)
    # numpy's arrays and Python's objects (the union-find's dicts) alike; 1 MB: what a step's first
    # task imports (numpy's lazily loaded functions), the fixed cost of a worker
    assert max(peaks.values()) <= 3 * partition_bytes + (1 << 20), max(
        peaks.items(), key=lambda x: x[1]
    )


@pytest.mark.slow
def test_partitions_drop_what_one_task_drops_in_bounded_memory(tmp_path, monkeypatch):
    check(tmp_path, 5_000, 5_000 * C.CLUSTER_ROW // 8, monkeypatch)


@pytest.mark.heavy  # ~100 s: make test-heavy
def test_200k_pairs_in_partitions(tmp_path, monkeypatch):
    check(tmp_path, 200_000, 200_000 * C.CLUSTER_ROW // 32, monkeypatch)


def test_components_in_rounds_are_the_connected_components(tmp_path):
    """Long paths and stars, in any node order: the labels are each component's least node."""
    rng = np.random.default_rng(5)
    nodes = rng.permutation(600).astype(np.uint64) + np.uint64(1 << 33)
    a, b = nodes[:-1], nodes[1:]
    keep = rng.random(len(a)) < 0.95  # paths of ~20
    edges = np.column_stack([a[keep], b[keep]])
    both = np.concatenate([edges, edges[:, ::-1]])
    path = tmp_path / "near" / "cluster"
    path.mkdir(parents=True)
    C.write_split(C.cluster_path(str(tmp_path), "edges", 0), both, C.part_of(both[:, 0], 4), 4)
    steps = C.Steps(str(tmp_path), Where(), set())
    source, before = ("edges", 0, 1), None
    for r in range(C.MAX_ROUNDS):
        got = steps.run(
            C.star, [C.StarJob(str(tmp_path), "large", r, p, 4, source) for p in range(4)]
        )
        now = (sum(g["fingerprint"] for g in got) % (1 << 64), sum(g["edges"] for g in got))
        if now == before:
            break
        before = now
        small = [C.StarJob(str(tmp_path), "small", r, p, 4, ("large", r, 4)) for p in range(4)]
        steps.run(C.star, small, results=False)
        source = ("small", r, 4)
    labels = np.concatenate(
        [C.read_split(C.cluster_path(str(tmp_path), "large", p, r), 4, 0, 4) for p in range(4)]
    )
    index = {int(x): i for i, x in enumerate(nodes)}
    ia = np.array([index[int(x)] for x in edges[:, 0]])
    ib = np.array([index[int(x)] for x in edges[:, 1]])
    comp = C._components(ia, ib, len(nodes))
    least = {}
    for i, c in enumerate(comp.tolist()):
        least[c] = min(least.get(c, nodes[i]), nodes[i])
    want = {
        int(nodes[i]): int(least[c]) for i, c in enumerate(comp.tolist()) if least[c] != nodes[i]
    }
    assert dict(zip(labels[:, 0].tolist(), labels[:, 1].tolist(), strict=True)) == want


@pytest.mark.slow
def test_a_rerun_redoes_only_the_task_that_failed(tmp_path, monkeypatch):
    made = bench.write_pairs(tmp_path / "a", bench.nodes_for(5_000), seed=4, band_parts=2)
    bench.write_pairs(tmp_path / "b", bench.nodes_for(5_000), seed=4, band_parts=2)
    partition_bytes = 5_000 * C.CLUSTER_ROW // 8
    whole = run_cluster(tmp_path / "b", made, partition_bytes)
    star, ran = C.star, []

    def failing(job):
        if job.name == "large-001-000003":
            raise RuntimeError("killed")
        return star(job)

    with monkeypatch.context() as m:
        m.setattr(C, "star", failing)
        with pytest.raises(RuntimeError, match="killed"):
            run_cluster(tmp_path / "a", made, partition_bytes)
    done = {p.name for p in (tmp_path / "a" / "near" / "done").iterdir()}
    assert "large-001-000002.json" in done and "large-001-000003.json" not in done

    def counted(fn):
        def run(job):
            ran.append(job.name)
            return fn(job)

        return run

    for name in ("scatter", "star", "join", "decide"):
        monkeypatch.setattr(C, name, counted(getattr(C, name)))
    again = run_cluster(tmp_path / "a", made, partition_bytes, done)
    assert [n for n in ran if not n.startswith(("join", "decide", "small-001", "large-002"))] == [
        "large-001-000003"
    ]
    assert again == whole
    for p in range(whole["parts"]):
        a, b = (C.remove_path(str(tmp_path / x), p) for x in "ab")
        assert Path(a).read_bytes() == Path(b).read_bytes(), p
