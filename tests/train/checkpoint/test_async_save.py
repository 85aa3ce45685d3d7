"""train.async_save's writer (train/checkpoint/async_save.py: BackgroundWriter): the state is staged
into one buffer kept across saves, only the part this rank writes, and written by a process of
its own; the checkpoint protocol (DONE last, retention) is the blocking save's. The loop's use of
it, on 2 fsdp ranks, is tests/train/distributed/test_fsdp.py:
test_async_save_writes_what_a_blocking_save_writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from codex.train.checkpoint import async_save
from codex.train.checkpoint import folders as checkpoint
from tests.fixtures.runs import child_env

ROOT = Path(__file__).resolve().parents[3]


def tiny_state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 16, generator=gen), "b": torch.randn(16, generator=gen)},
        "optimizer": {"adamw": {"state": {"w": {"step": torch.tensor(float(step))}}}},
        "step": step,
        "config": {"note": "json"},
    }


@pytest.mark.slow
def test_background_save_reuses_its_buffer_and_writes_in_another_process(tmp_path):
    run = str(tmp_path / "run")
    writer = async_save.BackgroundWriter()
    try:
        state = tiny_state(1)
        pending = async_save.save_in_background(run, state, writer, keep_last=2)
        ptrs = [v.data_ptr() for v in writer.cache.views]
        expected = state["model"]["w"].clone()
        state["model"]["w"].add_(1.0)  # training goes on: the checkpoint holds the staged copy
        assert pending.wait() == checkpoint.step_dir(run, 1)
        assert pending.writer_pid == writer.pid and writer.pid != os.getpid()
        assert torch.equal(checkpoint.load(run, 1)["model"]["w"], expected)

        for step in (2, 3):
            state["step"] = step
            pending = async_save.save_in_background(run, state, writer, keep_last=2)
            assert [v.data_ptr() for v in writer.cache.views] == ptrs  # the same buffer, no new one
            pending.wait()
        assert torch.equal(checkpoint.load(run, 3)["model"]["w"], state["model"]["w"])
        assert checkpoint.complete_steps(run) == [2, 3]  # retention, by the writer

        # Another shape: a new plan and buffer, mapped by the same writer process.
        state = tiny_state(4)
        state["model"]["extra"] = torch.arange(10.0)
        pid = writer.pid
        async_save.save_in_background(run, state, writer, keep_last=2).wait()
        assert writer.pid == pid
        loaded = checkpoint.load(run, 4)
        for k, t in state["model"].items():
            assert torch.equal(loaded["model"][k], t), k
        assert loaded["config"] == {"note": "json"}
    finally:
        writer.close()
    assert writer._link is not None and writer._link.process.returncode == 0


@pytest.mark.slow
def test_a_failed_background_save_is_raised_by_wait(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("a file where the checkpoints folder goes")
    writer = async_save.BackgroundWriter()
    try:
        pending = async_save.save_in_background(str(run), tiny_state(1), writer)
        with pytest.raises(OSError):
            pending.wait()
        with pytest.raises(OSError):
            pending.wait()  # every wait() raises it
    finally:
        writer.close()


def _two_ranks(rank: int, world: int, port: int, out: str) -> None:
    """One of 2 gloo ranks: a replicated tensor set and one DTensor sharded over both, saved twice
    in the background; what this rank staged goes to out/rank{rank}.json."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from codex.train.distributed.control import ControlPlane

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    control = ControlPlane(dist.new_group(backend="gloo"), rank, world)
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)  # the same tensors on every rank
    replicated = {f"r{i}": torch.randn(64 * (i + 1), 4, generator=gen) for i in range(6)}
    sharded = torch.randn(6, 4, generator=gen)
    state = {
        "model": {**replicated, "s": distribute_tensor(sharded, mesh, [Shard(0)])},
        "rng": {f"rank_{rank}": torch.tensor([rank])},
        "step": 1,
    }
    writer = async_save.BackgroundWriter(control)
    try:
        pending = async_save.save_in_background(out, state, writer)
        ptrs = [v.data_ptr() for v in writer.cache.views]
        pending.wait()
        state["step"] = 2
        async_save.save_in_background(out, state, writer).wait()
        assert writer.cache.plan is not None
        staged = [[s.key[0], list(s.shape)] for s in writer.cache.plan.slots]
        Path(out, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "staged": staged,
                    "nbytes": writer.cache.plan.nbytes,
                    "same_buffer": ptrs == [v.data_ptr() for v in writer.cache.views],
                    "writer_pid": pending.writer_pid,
                    "pid": os.getpid(),
                }
            )
        )
    finally:
        writer.close()
        dist.destroy_process_group()


@pytest.mark.slow
def test_each_rank_stages_only_what_it_writes(tmp_path):
    """2 ranks: DCP writes a replicated tensor once (its deduplication gives each to one rank, the
    less loaded), and each rank stages exactly those it was given plus its own DTensor shard:
    together once the state, not once per rank."""
    import torch.multiprocessing as mp

    from tests.fixtures.procs import free_port

    mp.spawn(_two_ranks, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["same_buffer"] and r["writer_pid"] != r["pid"]
    names = [{name for name, _ in r["staged"]} for r in ranks]
    replicated = {f"model.r{i}" for i in range(6)}
    assert not (names[0] & names[1]) - {"model.s"}  # no replicated tensor on both
    assert (names[0] | names[1]) >= replicated
    assert replicated & names[1]  # not all on rank 0: spread by size, as dcp.save does
    for r, rank in enumerate(ranks):
        shapes = {name: tuple(shape) for name, shape in rank["staged"]}
        assert shapes["model.s"] == (3, 4)  # its half of the DTensor
        assert f"rng.rank_{r}" in shapes
    total = 4 * (sum(64 * (i + 1) * 4 for i in range(6)) + 6 * 4) + 2 * 8
    assert sum(r["nbytes"] for r in ranks) <= total + 2 * 64 * 8  # the state once (+ alignment)

    loaded = checkpoint.load(str(tmp_path), 2)
    gen = torch.Generator().manual_seed(0)
    for i in range(6):
        assert torch.equal(loaded["model"][f"r{i}"], torch.randn(64 * (i + 1), 4, generator=gen))
    assert torch.equal(loaded["model"]["s"], torch.randn(6, 4, generator=gen))
    assert set(loaded["rng"]) == {"rank_0", "rank_1"}


_KILLED = """
import os, signal, sys, time
import torch
from codex.train.checkpoint import async_save
from codex.train.checkpoint import folders as checkpoint

run = sys.argv[1]
state = {"model": {"w": torch.ones(256, 256)}, "step": 1}
checkpoint.save(run, state)
writer = async_save.BackgroundWriter()
state["step"] = 2
async_save.save_in_background(run, state, writer)
print(writer.pid, flush=True)
time.sleep(0.5)  # the request is with the writer, which is still starting
os.kill(os.getpid(), signal.SIGKILL)  # the job dies while its background save is in flight
"""


@pytest.mark.slow
def test_a_job_killed_during_a_background_save_keeps_the_previous_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED, run],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    writer_pid = int(proc.stdout.split()[0])
    deadline = time.time() + 60
    while _alive(writer_pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(writer_pid), "the writer outlived its trainer"
    assert checkpoint.complete_steps(run) == [1]
    assert checkpoint.load(run, "latest")["step"] == 1


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status  # a zombie has exited
