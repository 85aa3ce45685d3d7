"""Two hosts simulated on the CPU: two `torchrun --nnodes=2 --nproc_per_node=1` agents on 127.0.0.1
with gloo, the tiny model. The control plane (train/dist/control.py) must keep them in step: one
stop step for a SIGTERM on one host, one resume step (or a loud failure), a failing rank ends the
job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.train_helpers import base_overrides, child_env, make_run
from train.checkpoint import folders as checkpoint

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_hosts(
    run: str, env_extra: dict | None = None, per_rank: dict | None = None, **train_keys
) -> list[subprocess.Popen]:
    """One torchrun agent per simulated host; per_rank[r] adds --set flags on host r only. The
    simulated hosts share this machine's disk, which they say with train.shared_run_dir."""
    train_keys = {"shared_run_dir": True, **train_keys}
    port = free_port()
    env = child_env() | (env_extra or {})
    procs = []
    for node in range(2):
        args = ["--run", run]
        for o in base_overrides(**train_keys) + (per_rank or {}).get(node, []):
            args += ["--set", o]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={node}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            "-m",
            "codex.cli",
            "--",
            "train",
            *args,
        ]
        # Own session: a test that times out kills the agent and its worker together (killpg).
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    errs = []
    for p in procs:
        try:
            errs.append(p.communicate(timeout=timeout)[1])
        except subprocess.TimeoutExpired:
            for q in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(q.pid, signal.SIGKILL)
            raise
    return errs


def worker_pid(agent: subprocess.Popen, timeout: float = 60) -> int:
    """The training process torchrun started (the agent's child)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(
            ["pgrep", "-P", str(agent.pid)], capture_output=True, text=True
        ).stdout.split()
        if out:
            return int(out[0])
        time.sleep(0.1)
    raise AssertionError("torchrun started no worker")


def train_steps(metrics: Path) -> list[int]:
    return [
        json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"train"' in line
    ]


def test_sigterm_on_one_host_stops_both_at_one_step_and_both_resume_there(tmp_path):
    run = make_run(tmp_path / "run")
    metrics = Path(run) / "metrics.jsonl"
    procs = start_hosts(run, max_steps=100_000)
    host1 = worker_pid(procs[1])
    deadline = time.time() + 90
    while time.time() < deadline and (not metrics.exists() or len(train_steps(metrics)) < 3):
        time.sleep(0.05)
    os.kill(host1, signal.SIGTERM)  # host 1 only: host 0 never sees a signal
    errs = finish(procs, timeout=90)
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    assert "SIGTERM received" in errs[1] and "SIGTERM received" not in errs[0]
    step = checkpoint.latest_step(run)
    # rank 0 saved the step both stopped at
    assert step is not None and step == train_steps(metrics)[-1]
    assert f"stopped by a signal at step {step}/" in errs[0]  # rank 0 stopped for host 1's signal
    assert f"rank 1/2: stopped at step {step}" in errs[1]

    procs = start_hosts(run, max_steps=step + 2)
    errs = finish(procs, timeout=90)
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    for r in (0, 1):
        assert f"rank {r}/2: resumed from step {step} " in errs[r], errs[r][-2000:]
    assert checkpoint.latest_step(run) == step + 2


def _checkpoints_at(run: str, steps: list[int]) -> None:
    """Checkpoints at `steps` from one process with the two hosts' global batch (2 x 4 rows)."""
    from codex.config import build_config
    from eval.evaluate import evaluate
    from train.loop import train

    train(
        build_config(
            overrides=base_overrides(max_steps=steps[-1], save_every=steps[0], device_batch=8),
            run=run,
        ),
        evaluate,
    )
    assert checkpoint.complete_steps(run) == steps


def test_a_read_fault_on_one_rank_never_splits_the_resume_step(tmp_path):
    """Rank 1 cannot open the newest checkpoint (step 4): rank 0 chose step 4, so the job fails on
    both ranks naming rank 1 and the path, instead of rank 1 falling back to step 2 alone."""
    run = make_run(tmp_path / "run")
    _checkpoints_at(run, [2, 4])
    procs = start_hosts(
        run, env_extra={"CODEX_TEST_FAIL_CKPT_READ_RANK": "1"}, max_steps=6, save_every=2
    )
    errs = finish(procs, timeout=120)
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    for err in errs:
        assert "rank 0 chose checkpoint step 4, but rank 1 could not load" in err, err[-2000:]
        assert "step_00000004" in err
    assert "resumed from step" not in errs[0] + errs[1]
    assert checkpoint.complete_steps(run) == [2, 4]  # nothing was trained or pruned


def test_an_exception_on_one_rank_ends_the_job_non_zero_within_60s(tmp_path):
    run = make_run(tmp_path / "run")
    t0 = time.time()
    procs = start_hosts(run, env_extra={"CODEX_TEST_RAISE_AT": "1:3"}, max_steps=100_000)
    errs = finish(procs, timeout=120)
    elapsed = time.time() - t0
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert "injected failure on rank 1 at step 3" in errs[1]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


def test_ranks_with_different_configs_refuse_to_start(tmp_path):
    run = make_run(tmp_path / "run")
    procs = start_hosts(run, per_rank={1: ["train.lr=0.02"]}, max_steps=2)
    errs = finish(procs, timeout=120)
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    for err in errs:
        assert "rank 1: train.lr=0.02 (rank 0: 0.01)" in err, err[-2000:]
        assert "exitcode  : 2" in err  # the worker's exit code (torchrun itself exits 1)
    assert not (Path(run) / "checkpoints").exists() or not checkpoint.complete_steps(run)


def test_two_nodes_on_a_local_run_directory_are_refused_unless_it_is_shared(tmp_path):
    """torchrun over 2 nodes (WORLD_SIZE 2, LOCAL_WORLD_SIZE 1) with a local --run: each node
    would see its own folder, so both exit 2 naming the fix; with train.shared_run_dir=true they
    pass the shared-folder check (every rank reads what rank 0 wrote) and train."""
    run = make_run(tmp_path / "run")
    procs = start_hosts(run, shared_run_dir=False, max_steps=2)
    errs = finish(procs, timeout=120)
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    for err in errs:
        assert "torchrun started 2 ranks, 1 on this node" in err, err[-2000:]
        assert "train.shared_run_dir=true" in err and "exitcode  : 2" in err
    assert not (Path(run) / "checkpoints").exists()

    procs = start_hosts(run, shared_run_dir=True, max_steps=2)
    errs = finish(procs, timeout=120)
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    assert checkpoint.latest_step(run) == 2
    assert not list(Path(run).glob(".codex-shared-*"))  # the proof file is removed


def _check_shared_dir(rank: int, world: int, port: int, folders: list[str], out: str) -> None:
    import torch.distributed as dist

    from codex.config import ConfigError
    from train.dist.control import ControlPlane

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        ControlPlane(dist.group.WORLD, rank, world).check_shared_dir(folders[rank])
        result = "ok"
    except ConfigError as e:
        result = str(e)
    Path(out, f"rank{rank}.txt").write_text(result)
    dist.destroy_process_group()


def test_ranks_that_see_different_folders_fail_the_shared_folder_check(tmp_path):
    """Two gloo ranks whose run directory is a different folder each (a node-local disk): rank 1
    cannot read rank 0's proof file, and both ranks raise naming rank 1; one folder passes."""
    import torch.multiprocessing as mp

    from tests.conftest import _free_port

    split = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    mp.spawn(_check_shared_dir, args=(2, _free_port(), split, str(tmp_path)), nprocs=2)
    for r in range(2):
        msg = (tmp_path / f"rank{r}.txt").read_text()
        assert msg.startswith("rank(s) 1 cannot see ") and "/.codex-shared-" in msg, msg
    shared = [str(tmp_path / "one")] * 2
    mp.spawn(_check_shared_dir, args=(2, _free_port(), shared, str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["ok", "ok"]
    assert not list((tmp_path / "one").iterdir())


def test_a_killed_torchrun_agent_takes_its_rank_down_and_the_job_stops(tmp_path):
    """SIGKILL of host 1's torchrun agent alone (not its worker): the worker gets the parent-death
    signal (SIGTERM), both ranks stop at one step, rank 0 saves it and the run lock is let go."""
    run = make_run(tmp_path / "run")
    metrics = Path(run) / "metrics.jsonl"
    procs = start_hosts(run, max_steps=100_000)
    workers = [worker_pid(p) for p in procs]
    deadline = time.time() + 90
    while time.time() < deadline and (not metrics.exists() or len(train_steps(metrics)) < 3):
        time.sleep(0.05)
    os.kill(procs[1].pid, signal.SIGKILL)  # the agent only

    def running(pid: int) -> bool:  # not gone, not a zombie
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 90
    while time.time() < deadline and any(running(w) for w in workers):
        time.sleep(0.2)
    alive = [w for w in workers if running(w)]
    # host 0's agent waits in torchrun's exit barrier for the dead agent (up to 5 minutes)
    for pid in alive + [procs[0].pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    errs = finish(procs, timeout=60)
    assert alive == [], errs[0][-2000:]
    step = checkpoint.latest_step(run)
    assert step == train_steps(metrics)[-1] and f"stopped by a signal at step {step}/" in errs[0]
    assert not (Path(run) / ".codex-lock.json").exists()
