"""Near-dedup's cluster step (pipeline/clean/near_cluster.py) on synthetic candidate pairs: every
task's peak memory against partition_bytes, and the time.

    PYTHONPATH=. python bench/bench_near_dedup_memory.py --pairs 50000000 --partition-mb 64 DIR

writes the pair files (as the band reduces would) under DIR in a child process, then runs the
cluster step with --workers local processes and prints each step's time, the partitions and rounds,
and the peak RSS (ru_maxrss) of the driver and of its pool processes: a task's peak is at most its
process's. tests/pipeline/clean/test_near_cluster.py holds the shape at 200k pairs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from codex.core.config.data import NearDedupConfig
from codex.pipeline.clean import near_cluster as C

BANDS = 14
BAND_PARTS = 16  # pair files a band (the band reduces' hash ranges)
DOCS_A_UNIT = 20_000


@dataclass
class Corpus:
    """Documents in pairs: node ids in corpus order, each one's component, the document whose
    text it has (itself, or for an exact copy its component's first), text hash and bytes."""

    node: np.ndarray
    comp: np.ndarray
    base: np.ndarray
    hash_a: np.ndarray
    nbytes: np.ndarray


def corpus(nodes: int, seed: int, copies: float = 0.05) -> Corpus:
    """Components of 2 + a geometric tail of documents (mean ~3.5, up to a few hundred), spread
    over the corpus; `copies` of the documents are exact copies of their component's first."""
    rng = np.random.default_rng(seed)
    sizes = 2 + np.minimum(rng.geometric(0.4, nodes // 2), 500)
    sizes = sizes[np.cumsum(sizes) <= nodes]
    comp = np.repeat(np.arange(len(sizes)), sizes)
    rng.shuffle(comp)
    flat = np.sort(rng.choice(4 * len(comp), size=len(comp), replace=False))
    node = ((flat // DOCS_A_UNIT).astype(np.uint64) << np.uint64(32)) | (flat % DOCS_A_UNIT).astype(
        np.uint64
    )
    first = np.full(len(sizes), len(comp), np.int64)
    np.minimum.at(first, comp, np.arange(len(comp)))
    base = np.arange(len(comp))
    pick = rng.random(len(comp)) < copies
    base[pick] = first[comp[pick]]
    hash_a = C.mix(base.astype(np.uint64) + np.uint64(seed))
    nbytes = C.mix(node) % np.uint64(20_000) + np.uint64(100)
    return Corpus(node, comp, base, hash_a, nbytes)


def band_pairs(c: Corpus, band: int) -> np.ndarray:
    """A band's pairs as a band reduce writes them: each component's documents in two signature
    groups (by a hash of the document whose text it has: exact copies share every band), each
    paired with its group's first document; columns as near_dedup's pairs (PAIR_WIDTH)."""
    salt = np.uint64(0x51ED270B27 * (band + 1))
    side = C.mix(c.base.astype(np.uint64) ^ salt) >> np.uint64(63)
    sig = c.comp.astype(np.uint64) * np.uint64(2) + side
    key_a, key_b = C.mix(sig ^ salt), C.mix(sig + salt)
    order = np.lexsort((c.node, key_b, key_a))
    first = np.ones(len(order), bool)
    first[1:] = sig[order][1:] != sig[order][:-1]
    head = order[np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))[~first]]
    later = order[~first]
    hash_b = C.mix(c.hash_a)
    cols = [c.node, c.hash_a, hash_b, c.nbytes]
    return np.column_stack(
        [x[head] for x in cols] + [x[later] for x in cols] + [key_b[head], key_a[head]]
    ).astype(np.uint64)


def pair_path(folder: Path, band: int, part: int) -> Path:
    return folder / "near" / f"pairs-{band:02d}-{part:04d}.npy"


def write_pairs(folder: Path, nodes: int, seed: int, band_parts: int = BAND_PARTS) -> dict:
    """The pair files of every band (band_parts a band, by the key's top bits) and band 0's later
    exact copies; returns the pairs, the units and the documents."""
    c = corpus(nodes, seed)
    (folder / "near").mkdir(parents=True, exist_ok=True)
    total = 0
    for band in range(BANDS):
        pairs = band_pairs(c, band)
        part = (pairs[:, 9] >> np.uint64(64 - (band_parts.bit_length() - 1))).astype(np.int64)
        part = part if band_parts > 1 else np.zeros(len(pairs), np.int64)
        for p in range(band_parts):
            np.save(pair_path(folder, band, p), pairs[part == p])
        total += len(pairs)
    copies = np.sort(c.node[c.base != np.arange(len(c.base))]).reshape(-1, 1)
    for p in range(band_parts):
        np.save(folder / "near" / f"copies-{p:04d}.npy", copies if p == 0 else copies[:0])
    units = int(c.node.max() >> np.uint64(32)) + 1 if len(c.node) else 0
    return {"pairs": total, "units": units, "nodes": len(c.node), "band_parts": band_parts}


def pair_files(folder: Path, band_parts: int = BAND_PARTS) -> list[C.PairFile]:
    return [
        C.PairFile(
            str(pair_path(folder, b, p)),
            b,
            str(folder / "near" / f"copies-{p:04d}.npy") if b == 0 else "",
        )
        for b in range(BANDS)
        for p in range(band_parts)
    ]


def nodes_for(pairs: int) -> int:
    """Documents that make about `pairs` pairs over BANDS bands (measured: ~0.59 a document a
    band with corpus()'s sizes)."""
    return int(pairs / BANDS / 0.59)


def _generate(folder: str, pairs: int, seed: int, queue) -> None:
    queue.put(write_pairs(Path(folder), nodes_for(pairs), seed))


def _cluster(folder: str, made: dict, partition_bytes: int, workers: int, queue) -> None:
    """The cluster step in this (fresh) process and a pool: what it reports, its time per step
    and the peak RSS of this process and of the pool's."""
    from codex.pipeline.executor import Where, stage_pool

    times: list[tuple[str, float]] = []
    run = C.Steps.run

    def timed(self, fn, jobs, results=True):
        t = time.perf_counter()
        got = run(self, fn, jobs, results)
        if jobs:
            times.append((jobs[0].name.rsplit("-", 1)[0], round(time.perf_counter() - t, 1)))
            print(f"  {times[-1][0]}: {len(jobs)} tasks, {times[-1][1]} s", flush=True)
        return got

    C.Steps.run = timed  # type: ignore[method-assign]
    nd = NearDedupConfig(partition_bytes=partition_bytes)
    t0 = time.perf_counter()
    with stage_pool(Where("local", workers)) as w:
        steps = C.Steps(folder, w, set())
        groups = -(-made["units"] // 4)
        got = C.cluster_pairs(steps, pair_files(Path(folder)), made["pairs"], nd, (groups, 4))
    got["seconds"] = time.perf_counter() - t0
    got["driver"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    got["pool"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    got.pop("groups")
    queue.put(got)


def _in_child(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, q))
    child.start()
    got = q.get()
    child.join()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--pairs", type=int, default=50_000_000)
    ap.add_argument("--partition-mb", type=float, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reuse", action="store_true", help="DIR's pair files, if it has them")
    args = ap.parse_args()
    t0 = time.perf_counter()
    made_at = Path(args.dir) / "made.json"
    if args.reuse and made_at.exists():  # the pair files of an earlier run: only the cluster again
        made = json.loads(made_at.read_text())
        shutil.rmtree(Path(args.dir) / "near" / "cluster", ignore_errors=True)
        shutil.rmtree(Path(args.dir) / "near" / "done", ignore_errors=True)
    else:
        made = _in_child(_generate, args.dir, args.pairs, args.seed)
        made_at.write_text(json.dumps(made))
    print(f"pairs {made} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    partition_bytes = int(args.partition_mb * (1 << 20))
    got = _in_child(_cluster, args.dir, made, partition_bytes, args.workers)
    bound = 3 * partition_bytes + (200 << 20)
    peak = max(got["driver"], got["pool"])
    print(
        json.dumps(
            {
                "pairs": made["pairs"],
                "documents": made["nodes"],
                "partition_bytes": partition_bytes,
                "partitions": got["parts"],
                "rounds": got["rounds"],
                "dropped": got["minhash"],
                "seconds": round(got["seconds"], 1),
                "us_per_pair": round(got["seconds"] / made["pairs"] * 1e6, 2),
                "driver_peak_mb": round(got["driver"] / 2**20),
                "pool_process_peak_mb": round(got["pool"] / 2**20),
                "bound_mb": round(bound / 2**20),
                "within": peak <= bound,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
