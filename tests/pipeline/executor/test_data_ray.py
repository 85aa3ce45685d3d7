"""The data stages on a real two-node Ray cluster (two raylets on this machine, conftest's
`ray_cluster`): the same bytes as the local executor, a big file cut into units that run in
parallel, a killed Ray worker retried, a killed driver resumed, gs:// in and out from every
worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from codex.core import fsio
from codex.pipeline.clean.clean import run_clean
from tests.fixtures.clean import (
    cfg_for,
    prose,
    ray_corpus,  # noqa: F401
)

ROOT = Path(__file__).resolve().parents[3]
CODEX = str(Path(sys.executable).parent / "codex")


def invoke(args: list[str]) -> None:
    from codex.cli.main import cli

    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output


def run_stages(run: str, inputs: str, executor: list[str]) -> None:
    invoke(
        ["data", "clean", "--run", run, "--input", inputs, *executor, "--txt-delimiter", "\\n\\n"]
        + ["--set", "data.clean.chunk_bytes=40000"]
    )
    invoke(["data", "tokenize", "--run", run, "--vocab-size", "300", *executor])
    invoke(
        ["data", "shard", "--run", run, "--shard-tokens", "4000", "--val-fraction", "0.1"]
        + executor
    )


def outputs(run: str) -> dict[str, bytes]:
    """Every file the issue names as the stages' output, by folder/name: the cleaned parts and
    stats.json, tokenizer.json, the shards and manifest.json."""
    wanted = {
        "clean": lambda n: n.startswith("part-") or n == "stats.json",
        "tokenizer": lambda n: n == "tokenizer.json",
        "shards": lambda n: n.endswith(".npy") or n == "manifest.json",
    }
    found = {}
    for sub, keep in wanted.items():
        for p in fsio.listdir(fsio.join(run, sub)):
            if keep(fsio.basename(p)):
                found[f"{sub}/{fsio.basename(p)}"] = fsio.read_bytes(
                    fsio.join(run, sub, fsio.basename(p))
                )
    return found


def markers(run: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run / "clean" / "markers").glob("*.json"))]


@pytest.mark.slow
def test_every_executor_gives_the_same_bytes(tmp_path, ray_cluster):
    ray_corpus(tmp_path / "in")
    runs = {
        "w1": ["--workers", "1"],
        "w2": ["--workers", "2"],
        "ray": ["--executor", "ray", "--ray-address", ray_cluster],
    }
    for name, executor in runs.items():
        run_stages(str(tmp_path / name), str(tmp_path / "in"), executor)
    ref = outputs(str(tmp_path / "w1"))
    parts = [n for n in ref if "part-" in n]
    shards = [n for n in ref if n.endswith(".npy")]
    assert len(parts) >= 8 and len(shards) >= 3, sorted(ref)
    stats = json.loads(ref["clean/stats.json"])
    assert stats["dedup_across_units"] > 0 and stats["units"] >= 8
    for name in ("w2", "ray"):
        got = outputs(str(tmp_path / name))
        assert sorted(got) == sorted(ref)
        assert [n for n in ref if got[n] != ref[n]] == [], name
    # the Ray run's units ran on both nodes of the cluster
    nodes = {m["worker"].split(":")[0] for m in markers(tmp_path / "ray")}
    assert len(nodes) == 2, [m["worker"] for m in markers(tmp_path / "ray")]
    assert all(n.startswith("ray-node-") for n in nodes)


@pytest.mark.slow
def test_a_200mb_file_is_cut_into_units_that_run_in_parallel(tmp_path, ray_cluster):
    """A single 200 MB .jsonl: lines over max_record_bytes are skipped unread (cheap), with 20 real
    documents between two of them (about 30 MB of work for the filters); 40 MB units cut it into
    5+, which the two nodes share, running two at a time (one per CPU)."""
    path = tmp_path / "in" / "huge.jsonl"
    path.parent.mkdir()
    oversized = json.dumps({"text": "x" * 70_000}) + "\n"
    real = oversized_lines = 0
    with open(path, "w") as f:
        while f.tell() < 200 << 20:
            f.write(oversized)
            oversized_lines += 1
            for _ in range(20):
                f.write(json.dumps({"text": prose(real)}) + "\n")
                real += 1
    args = ["data.clean.chunk_bytes=40000000", "data.clean.max_record_bytes=65536"]
    args += ["data.clean.allow_low_yield=true"]  # most of the bytes are the skipped lines
    cfg = cfg_for(tmp_path, [path], *args, run="run")
    cfg.data.executor, cfg.data.ray_address = "ray", ray_cluster
    stats = run_clean(cfg)
    path.unlink()
    units = [m for m in markers(tmp_path / "run") if m["pieces"][0][0] == str(path)]
    assert len(units) >= 5 and stats["units"] == len(units)
    assert stats["drops"]["length"]["too_long"] == oversized_lines
    assert stats["docs_in"] == oversized_lines + real and stats["docs_out"] > real // 2
    assert len({m["worker"].split(":")[0] for m in units}) == 2
    # the two nodes ran units of this one file at the same time
    events = sorted([(m["started"], 1) for m in units] + [(m["finished"], -1) for m in units])
    running = [sum(e for _, e in events[: i + 1]) for i in range(len(events))]
    assert max(running) == 2, events


def _ray_pids(title: str) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()[1:] if line.split()[1:2] == [title]]


def _kill_first_worker(title: str, after: float) -> tuple[threading.Thread, list[int]]:
    """A started thread that SIGKILLs the first Ray worker seen running `title`, `after` seconds
    into it; the list gets its pid."""
    killed: list[int] = []

    def kill() -> None:
        deadline = time.time() + 60
        while time.time() < deadline and not killed:
            pids = _ray_pids(title)
            if pids:
                time.sleep(after)
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.005)

    killer = threading.Thread(target=kill)
    killer.start()
    return killer, killed


@pytest.mark.slow
def test_a_killed_ray_worker_is_retried_and_the_output_is_unchanged(tmp_path, ray_cluster):
    ray_corpus(tmp_path / "in", big_docs=3000, small_files=0)
    args = ["data.clean.chunk_bytes=200000"]
    ref = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="ref"))
    # inside the unit: reading, writing its parts
    killer, killed = _kill_first_worker("ray::clean_unit", after=0.05)
    cfg = cfg_for(tmp_path, [tmp_path / "in"], *args, run="ray")
    cfg.data.executor, cfg.data.ray_address = "ray", ray_cluster
    got = run_clean(cfg)
    killer.join()
    assert killed, "no Ray worker was seen running a unit"
    assert got == ref and got["units"] >= 8
    ray_dir, ref_dir = tmp_path / "ray" / "clean", tmp_path / "ref" / "clean"
    for name in [p.name for p in ref_dir.glob("part-*.parquet")] + ["stats.json"]:
        assert (ray_dir / name).read_bytes() == (ref_dir / name).read_bytes(), name
    assert sorted(p.name for p in ray_dir.glob("part-*")) == sorted(
        p.name for p in ref_dir.glob("part-*")
    )
    assert not list(ray_dir.rglob(".tmp-*"))


@pytest.mark.slow
def test_a_killed_driver_then_a_rerun_does_only_the_rest(tmp_path, ray_cluster):
    ray_corpus(tmp_path / "in", big_docs=3000, small_files=0)
    args = ["--set", "data.clean.chunk_bytes=100000"]
    ref = run_clean(cfg_for(tmp_path, [tmp_path / "in"], args[1], run="ref"))
    run = tmp_path / "killed"
    cmd = [CODEX, "data", "clean", "--run", str(run), "--input", str(tmp_path / "in"), *args]
    cmd += ["--executor", "ray", "--ray-address", ray_cluster]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, start_new_session=True)
    folder = run / "clean" / "markers"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(folder.glob("*.json"))) < 4:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # Ray ends a dead driver's tasks; wait for that before counting what is done
    deadline = time.time() + 60
    while time.time() < deadline and _ray_pids("ray::clean_unit"):
        time.sleep(0.1)
    done_before = len(list(folder.glob("*.json")))
    assert 4 <= done_before < ref["units"], "the driver finished before it could be killed"
    assert not (run / "clean" / "stats.json").exists()
    cfg = cfg_for(tmp_path, [tmp_path / "in"], args[1], run="killed")
    cfg.data.executor, cfg.data.ray_address = "ray", ray_cluster
    again = run_clean(cfg)
    assert again.pop("units_run") == ref.pop("units_run") - done_before
    assert again == ref
    for p in (tmp_path / "ref" / "clean").glob("part-*.parquet"):
        assert (run / "clean" / p.name).read_bytes() == p.read_bytes()
    assert not list((run / "clean").rglob(".tmp-*"))


@pytest.mark.slow
def test_gcs_in_and_out_from_every_ray_worker(tmp_path, ray_cluster, gcs_bucket):
    ray_corpus(tmp_path / "in", big_docs=200, small_files=2)
    for p in (tmp_path / "in").iterdir():
        fsio.upload(str(p), f"{gcs_bucket}/in/{p.name}")
    run_stages(str(tmp_path / "local"), str(tmp_path / "in"), [])
    run_stages(
        f"{gcs_bucket}/run", f"{gcs_bucket}/in", ["--executor", "ray", "--ray-address", ray_cluster]
    )
    local, remote = outputs(str(tmp_path / "local")), outputs(f"{gcs_bucket}/run")
    # a unit's part on gs:// has a hash first in its name (fsio.spread): matched to the local
    # one by its place in stats.json's list
    names = [json.loads(m["clean/stats.json"])["shards"] for m in (local, remote)]
    assert len(names[0]) == len(names[1]) and any(a != b for a, b in zip(*names, strict=True))
    renamed = {f"clean/{b}": f"clean/{a}" for a, b in zip(*names, strict=True)}
    remote = {renamed.get(n, n): v for n, v in remote.items()}
    assert sorted(local) == sorted(remote) and len(local) > 6
    # The parts and stats.json name the source files (a local path here, gs:// there), and the
    # manifest fingerprints the parts' sizes: compare those with the paths taken out.
    differ = sorted(n for n in local if local[n] != remote[n])
    parts = [n for n in differ if n.startswith("clean/part-")]
    assert sorted(set(differ) - set(parts)) == ["clean/stats.json", "shards/manifest.json"]
    manifests = [json.loads(m["shards/manifest.json"]) for m in (local, remote)]
    for m in manifests:
        del m["settings"]["inputs_sha256"]
    assert manifests[0] == manifests[1]
    stats = [json.loads(m["clean/stats.json"]) for m in (local, remote)]
    for st in stats:
        st["shards"] = names[0]  # the same list, as checked above
        for row in st["per_file"]:
            row["path"] = row["path"].rsplit("/", 1)[-1]
        for row in st["sources"]:  # a plain --input source is named by its input
            row["source"] = row["source"].rstrip("/").rsplit("/", 1)[-1]
    assert stats[0] == stats[1]
    for n in parts:
        texts = [
            pq.read_table(pa.BufferReader(d)).column("text").to_pylist()
            for d in (local[n], remote[n])
        ]
        assert texts[0] == texts[1], n


@pytest.mark.slow
def test_a_killed_ray_worker_during_shard_is_retried_and_the_shards_are_unchanged(
    tmp_path, ray_cluster
):
    ray_corpus(tmp_path / "in", big_docs=1500, small_files=0)
    run = str(tmp_path / "run")
    invoke(
        ["data", "clean", "--run", run, "--input", str(tmp_path / "in")]
        + ["--set", "data.clean.docs_per_shard=60"]
    )
    invoke(["data", "tokenize", "--run", run, "--vocab-size", "300"])
    shard = ["data", "shard", "--run", run, "--shard-tokens", "20000", "--val-fraction", "0.1"]
    invoke([*shard, "--out", str(tmp_path / "ref")])
    killer, killed = _kill_first_worker("ray::shard_encode_unit", after=0.0)
    invoke(
        [*shard, "--out", str(tmp_path / "ray"), "--executor", "ray", "--ray-address", ray_cluster]
    )
    killer.join()
    assert killed, "no Ray worker was seen encoding a part"
    ref = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == ref
    for name in ref:
        if name.endswith((".npy", "manifest.json")):
            assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
