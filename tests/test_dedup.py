"""The corpus-wide dedup of `codex data clean` is a shuffle with bounded memory that keeps what
one pass over the corpus in order keeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from codex.pipeline.clean.clean import run_clean
from codex.pipeline.clean.dedup import HASH_ROW_BYTES, hash_buckets, partition_jobs
from tests.test_clean import cfg_for, make_corpus, read_out, snapshot

ROOT = Path(__file__).resolve().parent.parent


def test_many_partitions_keep_what_one_pass_keeps(tmp_path):
    make_corpus(tmp_path / "in", 8, 60, dup_every=5)
    small = "data.clean.chunk_bytes=30000"
    one = run_clean(cfg_for(tmp_path, [tmp_path / "in"], small, run="one"))
    many = run_clean(
        cfg_for(
            tmp_path, [tmp_path / "in"], small, "data.clean.dedup.partition_bytes=600", run="many"
        )
    )
    assert one["units"] >= 4 and one["dedup_across_units"] > 10
    assert len(list((tmp_path / "many" / "clean" / "dedup").glob("drops-*.npy"))) >= 16
    assert len(list((tmp_path / "one" / "clean" / "dedup").glob("drops-*.npy"))) == 1
    assert many == one and snapshot(tmp_path / "many") == snapshot(tmp_path / "one")
    # the first copy in corpus order is the one kept: ids are (file, offset), files sorted
    rows = read_out(str(tmp_path / "one"))
    texts = [r["text"] for r in rows]
    assert len(texts) == len(set(texts))
    first_seen: dict[str, tuple[str, int]] = {}
    for f in sorted((tmp_path / "in").glob("*.jsonl")):
        offset = 0
        for line in f.read_bytes().splitlines(keepends=True):
            first_seen.setdefault(json.loads(line)["text"], (str(f), offset))
            offset += len(line)
    kept = {r["text"]: r["id"] for r in rows}
    for text, rid in kept.items():
        path, offset = first_seen[text]
        assert rid == f"{path}@{offset}"


# VmHWM, this process's own peak (kB): ru_maxrss carries the parent's peak across fork + exec,
# so under a big pytest process the growth it shows would be 0 whatever the reduce holds
REDUCE = """
import json, sys
from codex.pipeline.clean.dedup import PartitionJob, dedup_partition
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
job = PartitionJob(**json.load(open(sys.argv[1])))
before = hwm()
result = dedup_partition(job)
after = hwm()
print(json.dumps({"grew_kb": after - before, "docs": result["docs"]}))
"""


def test_the_dedup_reduce_memory_is_bounded(tmp_path):
    """Hashes of 10x partition_bytes across 20 units: the reduce task for one partition grows by
    less than 4x partition_bytes (the bound: its share of the hashes, the sort's index and the
    sorted copy), so it never holds the corpus."""
    bound = 8 << 20
    units, rows = 20, (10 * bound) // HASH_ROW_BYTES // 20 + 1
    rng = np.random.default_rng(0)
    out = tmp_path / "clean"
    (out / "hashes").mkdir(parents=True)
    markers, dups = [], 0
    prev = np.zeros((0, 3), dtype=np.uint64)
    for u in range(units):
        h = rng.integers(0, 2**63, size=(rows, 3), dtype=np.uint64) * np.uint64(2)
        if u:  # 1% copies of the previous unit's documents
            h[: rows // 100] = prev[: rows // 100]
            dups += rows // 100
        prev = h
        h = h[np.lexsort((h[:, 1], h[:, 0]))]
        np.save(out / "hashes" / f"{u:06d}.npy", h)
        markers.append({"unit": f"{u:06d}", "docs_kept": rows, "hash_buckets": hash_buckets(h)})
    total = sum((out / "hashes" / f"{u:06d}.npy").stat().st_size for u in range(units))
    assert total >= 10 * bound
    jobs = partition_jobs(str(out), markers, bound)
    assert len(jobs) >= 10
    biggest = max(jobs, key=lambda j: sum(hi - lo for *_, lo, hi in j.sources))
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(biggest.__dict__))
    res = subprocess.run(
        [sys.executable, "-c", REDUCE, str(spec)], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["grew_kb"] * 1024 < 4 * bound, got
    # it did the work: this partition's share of the planted copies
    assert 0.5 * dups / len(jobs) < got["docs"] < 2 * dups / len(jobs)


def test_ray_executor_without_ray_installed_says_how_to_install_it(tmp_path):
    make_corpus(tmp_path / "in", 1, 5)
    code = (
        "import sys; sys.modules['ray'] = None\n"  # what a venv without the [ray] extra sees
        "from codex.cli.main import main; main()"
    )
    args = ["data", "clean", "--run", str(tmp_path / "r"), "--input", str(tmp_path / "in")]
    res = subprocess.run(
        [sys.executable, "-c", code, *args, "--executor", "ray"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2, res.stderr
    # one line saying how, before the stage did anything
    assert "clean:" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "ray" in ln.lower()]
    assert len(lines) == 1 and "pip install 'codex[ray]'" in lines[0], res.stderr
