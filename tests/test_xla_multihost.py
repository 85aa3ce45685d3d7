"""A 2-host TPU slice (v4-16: 2 hosts x 4 chips) simulated on the XLA CPU backend: two processes of
4 XLA CPU devices each run `codex train` through make_xla_backend's multi-host branch
(tests/xla_hosts.py says what is patched: the runtime's process count and index, the mesh over one
process's devices, the cross-host gradient mean over gloo). The reference is one process holding
all 8 devices, the same preset. Checked: the hosts' input shards make up the one-host global batch,
two hosts train the one-host model, a checkpoint moves between the two layouts in both
directions, and a SIGTERM on one host stops both at one step with a checkpoint there.

Run in the XLA venv:
    PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla tests/test_xla_multihost.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from codex.train.checkpoint import folders as checkpoint
from tests.test_multihost import finish, free_port
from tests.train_helpers import base_overrides, child_env, make_run
from tests.xla_hosts import RECORD_ENV

pytestmark = pytest.mark.xla

STEPS = 6


def start(run: str, hosts: int, record: str | None = None, **train) -> list[subprocess.Popen]:
    """`codex train` on `hosts` simulated hosts (v4-16's 8 chips split over them)."""
    keys = {
        "hardware": "v4-16",
        "allow_cpu_xla": True,
        "shared_run_dir": True,
        "device_batch": 1,
        "seq_len": 16,
        "batch_tokens": 256,  # 8 chips x 1 x 16 x accum 2
        "max_steps": STEPS,
        "save_every": 3,
        "dtype": "fp32",
        "lr": 1e-3,
        "dist_init_timeout_s": 120,
        **train,
    }
    args = ["train", "--run", run]
    for o in base_overrides(**keys):
        args += ["--set", o]
    env = child_env() | {
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(8 // hosts),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "CODEX_CONTROL_TIMEOUT_S": "120",
    }
    if record:
        env[RECORD_ENV] = record
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.xla_hosts", str(hosts), str(i), "--", *args],
            env=env | {"TPU_WORKER_ID": str(i)},  # as a TPU VM's metadata says (the run lock)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for i in range(hosts)
    ]


def finish_ok(procs: list[subprocess.Popen], timeout: float = 400) -> list[str]:
    """Every host's log (stderr) once all exited 0."""
    errs = finish(procs, timeout)
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(e[-3000:] for e in errs)
    return errs


def weights(run: str, step: int) -> dict[str, torch.Tensor]:
    return checkpoint.load(run, step, keys=("model",))["model"]


def resume_from(source: str, run: str, step: int) -> str:
    """A copy of `source` whose newest checkpoint is `step`."""
    shutil.copytree(source, run)
    for s in checkpoint.complete_steps(run):
        if s > step:
            shutil.rmtree(checkpoint.step_dir(run, s))
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("xla_hosts")
    one, two = make_run(tmp / "one_host"), make_run(tmp / "two_hosts")
    procs = start(one, 1, record=str(tmp / "batch_one")) + start(
        two, 2, record=str(tmp / "batch_two")
    )
    errs = finish_ok(procs)
    # resume across layouts: two hosts' step 3 on one host, one host's step 3 on two hosts
    on_one = resume_from(two, str(tmp / "two_then_one"), 3)
    on_two = resume_from(one, str(tmp / "one_then_two"), 3)
    resumed = finish_ok(start(on_one, 1) + start(on_two, 2))
    return {
        "one": one,
        "two": two,
        "on_one": on_one,
        "on_two": on_two,
        "errs": errs,
        "resumed_errs": resumed,
        "batches": {
            "one": torch.load(tmp / "batch_one.0.pt"),
            "two": [torch.load(tmp / f"batch_two.{i}.pt") for i in range(2)],
        },
    }


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_the_hosts_input_shards_make_up_the_one_host_batch(runs):
    (x1, y1), [(xa, ya), (xb, yb)] = runs["batches"]["one"], runs["batches"]["two"]
    # each host loads its own rows: half of the 8 chips' rows
    assert xa.shape[0] == xb.shape[0] == x1.shape[0] // 2
    assert not torch.equal(xa, xb)

    def rows(*xs):
        return sorted(tuple(r.tolist()) for x in xs for r in x.reshape(-1, x.shape[-1]))

    assert rows(xa, xb) == rows(x1) and rows(ya, yb) == rows(y1)


def test_two_hosts_train_the_one_host_model_and_both_write_the_checkpoint(runs):
    one, two = runs["one"], runs["two"]
    assert checkpoint.complete_steps(two) == checkpoint.complete_steps(one) == [3, STEPS]
    first, last = weights(one, 3), weights(one, STEPS)
    assert _max_diff(first, last) > 1e-3  # the weights moved
    assert _max_diff(weights(two, STEPS), last) < 1e-5
    files = sorted(p.name for p in Path(checkpoint.step_dir(two, STEPS)).glob("*.distcp"))
    assert len(files) == 2, files  # DCP over the hosts' gloo control plane: one file per host
    one_host, host0, _ = runs["errs"]
    assert "8 chip(s), 1 process(es)" in one_host
    assert "8 chip(s), 2 process(es)" in host0  # make_xla_backend's multi-host branch


def test_a_checkpoint_moves_between_one_and_two_hosts(runs):
    last = weights(runs["one"], STEPS)
    for run in (runs["on_one"], runs["on_two"]):
        assert checkpoint.latest_step(run) == STEPS
        assert _max_diff(weights(run, STEPS), last) < 1e-5, run
    one_host, host0, host1 = runs["resumed_errs"]
    assert "resumed from step 3" in one_host
    assert "rank 0/2: resumed from step 3" in host0 and "rank 1/2: resumed from step 3" in host1


def test_sigterm_on_one_host_stops_both_hosts_at_one_step(tmp_path):
    run = make_run(tmp_path / "run")
    metrics = Path(run) / "metrics.jsonl"
    procs = start(run, 2, max_steps=100_000, save_every=0, log_every=1)
    deadline = time.time() + 300
    while time.time() < deadline:
        steps = [json.loads(s)["step"] for s in _lines(metrics) if '"train"' in s]
        if len(steps) >= 3:
            break
        time.sleep(0.2)
    os.kill(procs[1].pid, signal.SIGTERM)  # host 1 only
    errs = finish_ok(procs)
    assert "SIGTERM received" in errs[1] and "SIGTERM received" not in errs[0]
    step = checkpoint.latest_step(run)
    assert step is not None and step >= 3
    assert f"stopped by a signal at step {step}/" in errs[0]
    assert f"rank 1/2: stopped at step {step}" in errs[1]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
