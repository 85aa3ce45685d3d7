"""The corpus-wide dedup of `codex data clean` is a shuffle with bounded memory that keeps what
one pass over the corpus in order keeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from codex.core import fsio
from codex.core.config.data import CleanConfig
from codex.pipeline.clean import dedup
from codex.pipeline.clean.clean import run_clean
from codex.pipeline.executor import Where
from tests.fixtures.clean import cfg_for, make_corpus, read_out, snapshot

ROOT = Path(__file__).resolve().parents[3]


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
# so under a big pytest process the growth it shows would be 0 whatever the task holds
TASK = """
import json, sys
from codex.pipeline.clean import dedup
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
kind, spec = sys.argv[1], json.load(open(sys.argv[2]))
job, fn = {
    "combine": (dedup.CombineJob, dedup.combine_group),
    "reduce": (dedup.ReduceJob, dedup.reduce_partition),
}[kind]
before = hwm()
result = fn(job(**spec))
after = hwm()
print(json.dumps({"grew_kb": after - before, **result}))
"""


def peak_of(tmp_path, kind: str, job) -> dict:
    """Run one dedup task in a fresh process: its result and how much its peak memory grew."""
    spec = tmp_path / f"{kind}.json"
    spec.write_text(json.dumps(job.__dict__))
    res = subprocess.run(
        [sys.executable, "-c", TASK, kind, str(spec)], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def write_units(out: Path, rows: list[np.ndarray]) -> list[dict]:
    """hashes/UUUUUU.npy for each unit's (n, 3) rows, sorted as a unit writes them; markers."""
    (out / "hashes").mkdir(parents=True)
    markers = []
    for u, h in enumerate(rows):
        np.save(out / "hashes" / f"{u:06d}.npy", h[np.lexsort((h[:, 1], h[:, 0]))])
        markers.append({"unit": f"{u:06d}", "docs_kept": len(h), "shards": []})
    return markers


def test_the_dedup_tasks_memory_is_bounded(tmp_path):
    """Hashes of 7.6x partition_bytes in 32 units, 1% of each unit copied from a unit of the group
    before: a combine task (4 units, a full group) and the reduce task of the biggest partition
    (about 0.95x partition_bytes) each grow by less than MEMORY_FACTOR (3) x partition_bytes:
    their share of the hashes, its concatenation and the sort's index and keys."""
    bound = 4 << 20
    units, rows = 32, int(0.95 * bound / dedup.ROW_BYTES / 4)
    rng = np.random.default_rng(0)
    hashes, dups = [], 0
    for u in range(units):
        h = rng.integers(0, 2**63, size=(rows, 3), dtype=np.uint64) * np.uint64(2)
        if u >= 4:
            h[: rows // 100] = hashes[u - 4][: rows // 100]
            dups += rows // 100
        hashes.append(h)
    out = tmp_path / "clean"
    markers = write_units(out, hashes)
    plan = dedup.plan_dedup(markers, bound)
    assert plan.partitions == 8 and len(plan.groups) == 8
    assert {b - a for a, b in plan.groups} == {4}
    jobs = dedup.dedup_jobs(str(out), markers, None, plan, set())
    for job in jobs.combine[1:]:
        assert dedup.combine_group(job)["copies"] == 0
    combined = peak_of(tmp_path, "combine", jobs.combine[0])
    assert combined["firsts"] == 4 * rows and combined["copies"] == 0
    assert combined["grew_kb"] * 1024 < dedup.MEMORY_FACTOR * bound, combined
    sizes = [
        len(dedup.read_indexed(str(out / "dedup" / "firsts-000000.npy"), 9, p)) for p in range(8)
    ]
    biggest = max(range(8), key=lambda p: sizes[p])
    reduced = peak_of(tmp_path, "reduce", jobs.reduce[biggest])
    assert reduced["grew_kb"] * 1024 < dedup.MEMORY_FACTOR * bound, reduced
    # it did the work: this partition's share of the planted copies
    assert 0.5 * dups / 8 < reduced["drops"] < 2 * dups / 8


def test_every_dedup_task_reads_a_bounded_number_of_files():
    """The plan for 100,000 units of 8 MB (2,000 documents of 4 KB each): no task opens more than
    ceil(sqrt(100,000)) = 317 files, where each reduce task of the old shuffle read one range of
    all 100,000 hash files. With 200-byte documents (40,000 a unit, 128 GB of rows), groups are cut
    at partition_bytes too: still within max_files_read."""
    n = 100_000
    for docs, groups, partitions, most in ((2_000, 316, 32, 317), (40_000, 479, 512, 513)):
        markers = [{"unit": f"{u:06d}", "docs_kept": docs, "shards": []} for u in range(n)]
        plan = dedup.plan_dedup(markers, 256 << 20)
        assert (len(plan.groups), plan.partitions) == (groups, partitions)
        jobs = dedup.dedup_jobs("out", markers, None, plan, set())
        assert len(jobs.combine) == len(jobs.rewrite) == groups
        assert len(jobs.reduce) == partitions
        reads = [dedup.files_read(j) for j in jobs.combine + jobs.reduce + jobs.rewrite]
        assert max(reads) == most <= dedup.max_files_read(n, n * docs, 256 << 20)
    assert dedup.ceil_sqrt(n) == 317


@pytest.mark.slow
def test_a_real_shuffle_opens_what_the_plan_says(tmp_path, monkeypatch):
    """2,000 tiny units (about 3 documents each, drawn from 2,000, so most are copies): each task
    opens exactly files_read(job) files, at most ceil(sqrt(2,000)) = 45, and the documents dropped
    are those one pass in corpus order drops."""
    n = 2_000
    rng = np.random.default_rng(1)
    pool = rng.integers(0, 2**63, size=(n, 2), dtype=np.uint64)
    hashes, seen, expected = [], set(), 0
    for _ in range(n):
        h = np.unique(pool[rng.integers(0, n, size=3)], axis=0)
        hashes.append(np.column_stack([h, np.full(len(h), 100, dtype=np.uint64)]))
        for row in h.tolist():
            expected += tuple(row) in seen
            seen.add(tuple(row))
    out = tmp_path / "clean"
    markers = write_units(out, hashes)
    opened: list[str] = []
    real_open = fsio.open

    def counting_open(path, *a, **k):
        opened.append(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(fsio, "open", counting_open)
    per_task = []
    for name in ("combine_group", "reduce_partition", "rewrite_group"):
        fn = getattr(dedup, name)

        def spy(job, fn=fn):
            opened.clear()
            result = fn(job)
            per_task.append((len(set(opened)), len(opened), dedup.files_read(job)))
            return result

        monkeypatch.setattr(dedup, name, spy)
    docs, nbytes = dedup.dedup_corpus(str(out), markers, CleanConfig(), Where())
    assert (docs, nbytes) == (expected, 100 * expected) and expected > n // 2
    assert len(per_task) == 2 * 45 + 1  # 45 groups of up to 45 units, 1 partition
    assert all(files == opens == planned <= 45 for files, opens, planned in per_task), per_task


class Killed(Exception):
    """Stands for the process dying in the middle of the dedup."""


@pytest.mark.slow
@pytest.mark.parametrize("level", ["reduce_partition", "rewrite_group"])
def test_a_killed_dedup_reruns_only_its_unfinished_tasks(tmp_path, monkeypatch, level):
    """Units in groups of 2 and 8 hash partitions; the run dies in the 4th reduce (or rewrite)
    task, after its files and before its marker. The rerun cleans no unit, runs no finished task
    again (their markers are untouched) and gives the bytes and stats of a run that was never
    killed."""
    make_corpus(tmp_path / "in", 8, 60, dup_every=5)
    args = ("data.clean.chunk_bytes=30000", "data.clean.dedup.partition_bytes=2000")
    ref = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="ref"))
    folder = tmp_path / "run" / "clean" / "dedup"
    plan = json.loads((tmp_path / "ref" / "clean" / "dedup" / "plan.json").read_text())
    assert plan["partitions"] == 8 and plan["groups"] >= 4
    calls: dict[str, list[int]] = {}
    for name in ("combine_group", "reduce_partition", "rewrite_group"):
        fn = getattr(dedup, name)

        def spy(job, fn=fn, name=name):
            calls.setdefault(name, []).append(job.index)
            result = fn(job)
            if name == level and kill and len(calls[name]) == 4:
                # killed after the task's files, before its marker: a rewrite has rewritten parts
                (folder / f"{name.split('_')[0]}-{job.index:06d}.json").unlink()
                raise Killed(name)
            return result

        monkeypatch.setattr(dedup, name, spy)
    kill = True
    with pytest.raises(Exception, match=level):
        run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="run"))
    assert not (tmp_path / "run" / "clean" / "stats.json").exists()
    finished = {p.name: p.stat().st_mtime_ns for p in folder.glob("*-*.json")}
    kind = level.split("_")[0]
    tasks = plan["partitions"] if kind == "reduce" else plan["groups"]
    left = [i for i in range(tasks) if f"{kind}-{i:06d}.json" not in finished]
    assert 3 in left and 0 < len(left) < tasks
    calls.clear()
    kill = False
    again = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="run"))
    assert again["units_run"] == 0
    assert calls[level] == left and "combine_group" not in calls
    if level == "rewrite_group":
        assert "reduce_partition" not in calls
    assert finished == {n: (folder / n).stat().st_mtime_ns for n in finished}
    assert snapshot(tmp_path / "run") == snapshot(tmp_path / "ref")
    ref.pop("units_run"), again.pop("units_run")
    assert again == ref


def test_a_unit_cleaned_again_starts_the_dedup_over(tmp_path, monkeypatch):
    """The run dies after the first rewrite task (units 0 and 1 rewritten); unit 1's hash file is
    then lost, so the rerun cleans unit 1 again (its parts hold their later copies once more).
    The dedup's markers were made from the old unit: the dedup starts over, and the output is
    that of a run that was never killed."""
    make_corpus(tmp_path / "in", 8, 60, dup_every=5)
    args = ("data.clean.chunk_bytes=30000", "data.clean.dedup.partition_bytes=2000")
    ref = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="ref"))
    rewrite = dedup.rewrite_group

    def die_after_the_first(job):
        rewrite(job)
        raise Killed("rewrite")

    monkeypatch.setattr(dedup, "rewrite_group", die_after_the_first)
    with pytest.raises(Exception, match="rewrite"):
        run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="run"))
    monkeypatch.undo()
    clean = tmp_path / "run" / "clean"
    assert (clean / "dedup" / "rewrite-000000.json").exists()
    assert (
        snapshot(tmp_path / "run")["part-000001-000.parquet"]
        == snapshot(tmp_path / "ref")["part-000001-000.parquet"]
    )
    (clean / "hashes" / "000001.npy").unlink()
    again = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="run"))
    assert again["units_run"] == 1
    assert snapshot(tmp_path / "run") == snapshot(tmp_path / "ref")
    ref.pop("units_run"), again.pop("units_run")
    assert again == ref


@pytest.mark.slow
def test_the_shuffle_on_gcs_keeps_what_it_keeps_locally(tmp_path, gcs_bucket):
    """Groups and partitions on gs://: ranges read on threads, markers, a rerun that finds
    every marker: the same documents and drops as the local run."""
    make_corpus(tmp_path / "in", 4, 50, dup_every=5)
    args = ("data.clean.chunk_bytes=30000", "data.clean.dedup.partition_bytes=2000")
    local = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="local"))
    cfg = cfg_for(tmp_path, [tmp_path / "in"], *args, run=f"{gcs_bucket}/run")
    remote = run_clean(cfg)
    assert local["dedup_across_units"] > 5
    for key in ("dedup_across_units", "drops", "docs_out", "bytes_out"):
        assert remote[key] == local[key], key
    assert sorted((r["id"], r["text"]) for r in read_out(f"{gcs_bucket}/run")) == sorted(
        (r["id"], r["text"]) for r in read_out(str(tmp_path / "local"))
    )
    folder = f"{gcs_bucket}/run/clean/dedup"
    plan = fsio.read_json(f"{folder}/plan.json")
    assert plan["groups"] >= 3 and plan["partitions"] >= 2, plan
    markers = [p for p in fsio.listdir(folder) if p.endswith(".json")]
    assert len(markers) == 1 + 2 * plan["groups"] + plan["partitions"]
    fsio.rm(f"{gcs_bucket}/run/clean/stats.json")
    assert run_clean(cfg) == {**remote, "units_run": 0}


@pytest.mark.slow
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
