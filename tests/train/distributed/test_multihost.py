"""Two hosts simulated on the CPU: two `torchrun --nnodes=2 --nproc_per_node=1` agents on 127.0.0.1
with gloo, the tiny model. The control plane (train/distributed/control.py) must keep them in step:
one
stop step for a SIGTERM on one host, one resume step (or a loud failure), a failing, killed or hung
rank ends the job. Below them, without a GPU: the environment set before the process group (NCCL
flight recorder, socket interface), the abort on a failed CUDA rank, one GPU per process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from codex.train.checkpoint import folders as checkpoint
from tests.fixtures.procs import children, finish, free_port, host_stacks  # noqa: F401
from tests.fixtures.runs import base_overrides, child_env, make_run

ROOT = Path(__file__).resolve().parents[3]


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


def worker_pid(agent: subprocess.Popen, timeout: float = 60) -> int:
    """The training process torchrun started (the agent's child)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if found := children(agent.pid):
            return found[0]
        time.sleep(0.1)
    raise AssertionError("torchrun started no worker")


def train_steps(metrics: Path) -> list[int]:
    return [
        json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"train"' in line
    ]


@pytest.mark.slow
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
    from codex.core.config import build_config
    from codex.eval.evaluate import evaluate
    from codex.train.loop import train

    train(
        build_config(
            overrides=base_overrides(max_steps=steps[-1], save_every=steps[0], device_batch=8),
            run=run,
        ),
        evaluate,
    )
    assert checkpoint.complete_steps(run) == steps


@pytest.mark.slow
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


@pytest.mark.slow
def test_an_exception_on_one_rank_ends_the_job_non_zero_within_60s(tmp_path):
    run = make_run(tmp_path / "run")
    t0 = time.time()
    procs = start_hosts(run, env_extra={"CODEX_TEST_RAISE_AT": "1:3"}, max_steps=100_000)
    errs = finish(procs, timeout=120)
    elapsed = time.time() - t0
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert "injected failure on rank 1 at step 3" in errs[1]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


def running(pid: int) -> bool:
    """Not gone and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for_steps(procs: list[subprocess.Popen], metrics: Path, n: int, timeout: float = 90):
    """Until rank 0 logged step n (an error with the agents' output if a host ended first)."""
    deadline = time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or len(train_steps(metrics)) < n):
        if any(p.poll() is not None for p in procs):
            errs = finish(procs, timeout=30)
            raise AssertionError(
                f"a host ended before step {n}: {errs[0][-2000:]}{errs[1][-2000:]}"
            )
        time.sleep(0.05)
    assert metrics.exists() and len(train_steps(metrics)) >= n, f"the job never reached step {n}"


@pytest.mark.slow
def test_a_rank_killed_mid_step_ends_the_job_non_zero_within_60s(tmp_path):
    """SIGKILL of host 1's worker while both train (no Python unwinds there, no close): host 0's
    rank is in the step's gradient all-reduce or the stop flag, sees the dead peer's sockets
    close, raises, skips the clean-exit barrier and exits non-zero; its agent with it."""
    run = make_run(tmp_path / "run")
    metrics = Path(run) / "metrics.jsonl"
    procs = start_hosts(run, max_steps=100_000)
    workers = [worker_pid(p) for p in procs]
    wait_for_steps(procs, metrics, 3)
    t0 = time.time()
    os.kill(workers[1], signal.SIGKILL)
    while time.time() < t0 + 90 and (running(workers[0]) or procs[0].poll() is None):
        time.sleep(0.1)
    elapsed = time.time() - t0
    errs = finish(procs, timeout=30)
    assert not running(workers[0]) and procs[0].returncode not in (0, None), errs[0][-2000:]
    assert procs[1].returncode != 0
    assert elapsed < 60, f"host 0 took {elapsed:.0f} s to end after its peer was killed"
    assert "Traceback" in errs[0] and "exitcode  : 1" in errs[0], errs[0][-2000:]


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_after_dist_timeout_s_but_start_up_may_take_longer(tmp_path):
    """Host 1 stalls 8 s before step 0 (start-up: collectives wait train.dist_init_timeout_s, so the
    job goes on) and 15 s before step 3 (after the first step train.dist_timeout_s=3 holds): host
    0 times out in that step's all-reduce about 3 s in and exits non-zero, long before the stall
    ends (the 30-minute default before this existed)."""
    run = make_run(tmp_path / "run")
    metrics = Path(run) / "metrics.jsonl"
    procs = start_hosts(
        run, env_extra={"CODEX_TEST_STALL_AT": "1:0:8,1:3:15"}, max_steps=6, dist_timeout_s=3
    )
    host1 = worker_pid(procs[1])
    wait_for_steps(procs, metrics, 3, timeout=120)  # steps 0-2 passed the 8 s start-up stall
    t0 = time.time()
    try:
        procs[0].wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    elapsed = time.time() - t0
    with contextlib.suppress(ProcessLookupError):  # host 1 sleeps on; its peer is gone
        os.kill(host1, signal.SIGKILL)
    errs = finish(procs, timeout=60)
    assert procs[0].returncode != 0, errs[0][-2000:]
    assert "collectives now time out after 3 s (train.dist_timeout_s)" in errs[0]
    assert "timed out" in errs[0].lower() or "timeout" in errs[0].lower(), errs[0][-2000:]
    assert train_steps(metrics) == [1, 2, 3]
    assert elapsed < 12, f"host 0 took {elapsed:.0f} s to end while its peer hung"


@pytest.mark.slow
def test_ranks_with_different_configs_refuse_to_start(tmp_path):
    run = make_run(tmp_path / "run")
    procs = start_hosts(run, per_rank={1: ["train.lr=0.02"]}, max_steps=2)
    errs = finish(procs, timeout=120)
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    for err in errs:
        assert "rank 1: train.lr=0.02 (rank 0: 0.01)" in err, err[-2000:]
        assert "exitcode  : 2" in err  # the worker's exit code (torchrun itself exits 1)
    assert not (Path(run) / "checkpoints").exists() or not checkpoint.complete_steps(run)


@pytest.mark.slow
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

    from codex.core.config import ConfigError
    from codex.train.distributed.control import ControlPlane

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


@pytest.mark.slow
def test_ranks_that_see_different_folders_fail_the_shared_folder_check(tmp_path):
    """Two gloo ranks whose run directory is a different folder each (a node-local disk): rank 1
    cannot read rank 0's proof file, and both ranks raise naming rank 1; one folder passes."""
    import torch.multiprocessing as mp

    from tests.fixtures.procs import free_port

    split = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    mp.spawn(_check_shared_dir, args=(2, free_port(), split, str(tmp_path)), nprocs=2)
    for r in range(2):
        msg = (tmp_path / f"rank{r}.txt").read_text()
        assert msg.startswith("rank(s) 1 cannot see ") and "/.codex-shared-" in msg, msg
    shared = [str(tmp_path / "one")] * 2
    mp.spawn(_check_shared_dir, args=(2, free_port(), shared, str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["ok", "ok"]
    assert not list((tmp_path / "one").iterdir())


@pytest.mark.slow
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


# --- below the process group, without a GPU -----------------------------------------------------


@pytest.mark.slow
def test_the_flight_recorder_is_set_for_cuda_where_unset_with_its_dump_in_the_run_dir(tmp_path):
    from codex.train.distributed.process_env import process_group_env

    run = str(tmp_path / "run")
    one_host = {"MASTER_ADDR": "127.0.0.1"}
    assert process_group_env("cuda", run, one_host) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{run}/logs/nccl_trace_rank_",
    }
    # what the user set stays (the newer TORCH_FR_* names count too); gs://: torch's /tmp default
    user = one_host | {"TORCH_FR_BUFFER_SIZE": "100", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert process_group_env("cuda", "gs://bucket/run", user) == {}
    assert process_group_env("cuda", run, {"TORCH_FR_DUMP_TEMP_FILE": "/x/fr_"}) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    assert process_group_env("cpu", run, one_host) == {}  # gloo has no flight recorder


def _local_ipv4_interfaces() -> dict[str, str]:
    """{address: interface} for this machine's non-loopback IPv4 addresses, from `ip` (not the
    code under test)."""
    import shutil

    if not shutil.which("ip"):
        return {}
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    found = {}
    for line in out.stdout.splitlines():  # "2: eth0    inet 192.0.2.2/24 brd ... scope global eth0"
        fields = line.split()
        address = fields[3].split("/")[0]
        if not address.startswith("127."):
            found[address] = fields[1]
    return found


@pytest.mark.slow
def test_the_socket_interface_is_the_one_that_reaches_master_addr(tmp_path):
    """route_interface: the interface whose address the kernel sends from to MASTER_ADDR (lo for
    127.0.0.1; this machine's own address is held by its interface). process_group_env sets
    GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on CUDA) from it only for a MASTER_ADDR that is not
    loopback (several hosts) and only where unset."""
    from codex.train.distributed.process_env import process_group_env, route_interface

    assert route_interface("127.0.0.1") == "lo"
    assert route_interface("localhost") == "lo"
    assert process_group_env("cpu", str(tmp_path), {"MASTER_ADDR": "127.0.0.1"}) == {}
    assert process_group_env("cpu", str(tmp_path), {"MASTER_ADDR": "localhost"}) == {}
    assert route_interface("no-such-host.invalid") is None
    local = _local_ipv4_interfaces()
    if not local:
        pytest.skip("no non-loopback IPv4 address (or no `ip`) on this machine")
    for address, interface in local.items():
        assert route_interface(address) == interface, (address, local)
    address, interface = next(iter(local.items()))
    master = {"MASTER_ADDR": address}
    assert process_group_env("cpu", str(tmp_path), master) == {"GLOO_SOCKET_IFNAME": interface}
    cuda = process_group_env("cuda", "gs://b/run", master | {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"})
    assert cuda == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
        "GLOO_SOCKET_IFNAME": interface,
        "NCCL_SOCKET_IFNAME": interface,
    }
    mine = master | {"GLOO_SOCKET_IFNAME": "ib0"}
    assert process_group_env("cpu", str(tmp_path), mine) == {}


@pytest.mark.slow
def test_a_failed_cuda_rank_aborts_its_process_groups_without_waiting(monkeypatch):
    """close(ok=False) on CUDA: ncclCommAbort on every group (c10d._abort_process_group), no
    clean-exit barrier; gloo (CPU) destroys its group, which closes the sockets."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from codex.train.distributed.backend import TorchBackend

    calls: list[str] = []

    class Control:
        def barrier(self):
            calls.append("barrier")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: calls.append("abort"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: calls.append("destroy"))
    for kind, device, ok, want in [
        ("cuda", torch.device("cuda", 0), False, ["abort"]),
        ("cpu", torch.device("cpu"), False, ["destroy"]),
        ("cuda", torch.device("cuda", 0), True, ["barrier", "destroy"]),
    ]:
        calls.clear()
        backend = TorchBackend(kind=kind, device=device, world_size=2, distributed=True)
        backend.control = Control()  # type: ignore[assignment]
        backend.close(ok=ok)
        assert calls == want, (kind, ok, calls)


@pytest.mark.slow
def test_one_gpu_per_process_runs_on_its_cuda_0(monkeypatch):
    """Slurm --gpus-per-task=1: each of 8 processes on a host sees one GPU (CUDA_VISIBLE_DEVICES
    names one), so local rank 3 runs on cuda:0; without that binding one GPU for 8 processes is
    still refused, and 8 visible GPUs give local rank 3 cuda:3."""
    import torch

    from codex.train.distributed.backend import BackendError, _cuda_device
    from codex.train.plan.presets import get_preset

    count = {"n": 1}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count["n"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "H100")
    # the TF32 switches _cuda_device turns on, kept away from the rest of this process
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(allow_tf32=False))
    monkeypatch.setattr(torch.backends, "cudnn", SimpleNamespace(allow_tf32=False))
    preset = get_preset("h100-8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert _cuda_device(preset, 3, 8) == torch.device("cuda", 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f6c1f7e-0000-0000-0000-000000000000")
    assert _cuda_device(preset, 7, 8) == torch.device("cuda", 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(BackendError, match="wants 8 GPU"):
        _cuda_device(preset, 3, 8)
    count["n"] = 8
    assert _cuda_device(preset, 3, 8) == torch.device("cuda", 3)


def _first_step_timeouts(rank: int, world: int, port: int, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from codex.train.distributed.backend import TorchBackend
    from codex.train.distributed.control import ControlPlane

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    control = ControlPlane(
        dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=500)), rank, world
    )
    mesh = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))  # a mesh dim
    backend = TorchBackend(
        kind="cpu",
        device=torch.device("cpu"),
        rank=rank,
        world_size=world,
        distributed=True,
        control=control,
        step_timeout_s=7,
    )
    backend.first_step_done()
    cpu = torch.device("cpu")
    groups = [dist.group.WORLD, mesh, control.group]
    seconds = [g._get_backend(cpu).options._timeout.total_seconds() for g in groups if g]
    Path(out, f"rank{rank}.json").write_text(json.dumps(seconds))
    backend.close(ok=True)


@pytest.mark.slow
def test_after_the_first_step_every_group_but_the_control_planes_gets_dist_timeout_s(tmp_path):
    """first_step_done: the default group and any other (an FSDP mesh dimension) get
    train.dist_timeout_s; the control plane's group keeps its own (it waits for checkpoint
    writes)."""
    import torch.multiprocessing as mp

    from tests.fixtures.procs import free_port

    mp.spawn(_first_step_timeouts, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got == [7, 7, 500], got
