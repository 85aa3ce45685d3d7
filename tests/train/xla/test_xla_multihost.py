"""A 2-host TPU slice (v4-16: 2 hosts x 4 chips) simulated on the XLA CPU backend: two processes of
4 XLA CPU devices each run `codex train` through make_xla_backend's multi-host branch
(tests/fixtures/xla_hosts.py says what is patched: the runtime's process count and index, the mesh
over one
process's devices, the cross-host gradient mean over gloo). The reference is one process holding
all 8 devices, the same preset.

The runs train under train.parallel=fsdp: one host shards the state over its 8 chips, two hosts
over each host's 4 (the simulation's mesh stops at a host: HSDP, tests/fixtures/xla_hosts.py).
Checked:
the hosts' input shards make up the one-host global batch, two hosts train the one-host model and
each writes about half of every checkpoint, a checkpoint moves 2 -> 2, 2 -> 1 and 1 -> 2 hosts
(8-way chunks read as 4-way pieces and back) to the same weights, and the resume's memory stays
within the plan (the state arrives sharded, never whole on a chip). A SIGTERM on one host stops
both at one step with a checkpoint there (replicated).

Run in the XLA venv:
    PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla tests/train/xla/test_xla_multihost.py
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
from tests.fixtures.procs import finish, free_port
from tests.fixtures.runs import base_overrides, child_env, make_run
from tests.fixtures.xla_hosts import RECORD_ENV, RSS_ENV

# ~4.5 minutes of two and three XLA processes: `make test-heavy`
pytestmark = [pytest.mark.xla, pytest.mark.heavy]

STEPS = 6
# Large enough that the state (16 bytes a parameter, 3.4M parameters) stands out in the resume's
# memory, small enough to train 6 steps in seconds.
MODEL = ["model.n_embd=384", "model.n_head=4"]


def start(
    run: str,
    hosts: int,
    record: str | None = None,
    rss: str | None = None,
    model: tuple[str, ...] = (),
    **train,
) -> list[subprocess.Popen]:
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
    for o in [*base_overrides(**keys), *model]:
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
    if rss:
        env[RSS_ENV] = rss
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.fixtures.xla_hosts", str(hosts), str(i), "--", *args],
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


def start_fsdp(run: str, hosts: int, **kw) -> list[subprocess.Popen]:
    """fsdp over each host's chips: 8 on one host, 4 on each of two (HSDP across them)."""
    return start(
        run,
        hosts,
        model=tuple(MODEL),
        parallel="fsdp",
        fsdp_size=8 // hosts,
        optimizer="adamw",
        **kw,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("xla_hosts")
    one, two = make_run(tmp / "one_host"), make_run(tmp / "two_hosts")
    procs = start_fsdp(one, 1, record=str(tmp / "batch_one")) + start_fsdp(
        two, 2, record=str(tmp / "batch_two")
    )
    errs = finish_ok(procs)
    # resume across layouts: two hosts' step 3 on one host and on two, one host's on two hosts
    on_one = resume_from(two, str(tmp / "two_then_one"), 3)
    on_two = resume_from(one, str(tmp / "one_then_two"), 3)
    again = resume_from(two, str(tmp / "two_then_two"), 3)
    resumed = finish_ok(
        start_fsdp(on_one, 1) + start_fsdp(on_two, 2, rss=str(tmp / "rss")) + start_fsdp(again, 2)
    )
    return {
        "one": one,
        "two": two,
        "on_one": on_one,
        "on_two": on_two,
        "again": again,
        "errs": errs,
        "resumed_errs": resumed,
        "rss": [json.loads((tmp / f"rss.{i}.json").read_text()) for i in range(2)],
        "batches": {
            "one": torch.load(tmp / "batch_one.0.pt"),
            "two": [torch.load(tmp / f"batch_two.{i}.pt") for i in range(2)],
        },
    }


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _mean_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return sum((a[k] - b[k]).abs().sum().item() for k in a) / sum(a[k].numel() for k in a)


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
    # Two hosts sum the gradients in another order (fsdp over 4, then across hosts) than one host
    # over 8: AdamW divides by each element's gradient scale, so a rounding difference in a small
    # gradient moves a few elements by up to ~lr (measured: 0.001% of them above 1e-5, at most
    # 3e-5); on average the runs agree to 1e-8, against 5e-4 the weights moved.
    two_hosts = weights(two, STEPS)
    assert _max_diff(two_hosts, last) < 1e-4
    assert _mean_diff(two_hosts, last) < 1e-4 * _mean_diff(first, last)
    one_host, host0, _ = runs["errs"]
    assert "8 chip(s), 1 process(es)" in one_host
    assert "8 chip(s), 2 process(es)" in host0  # make_xla_backend's multi-host branch
    assert "fsdp over 8 devices" in one_host and "fsdp over 4 devices x 2 replicas" in host0


def test_each_host_writes_about_half_of_the_fsdp_checkpoint(runs):
    """Each host writes the shards DCP's deduplication gives it (its chips hold a whole replica, so
    every shard is on both hosts): about half the bytes each, never all of them."""
    folder = Path(checkpoint.step_dir(runs["two"], STEPS))
    files = {p.name: p.stat().st_size for p in folder.glob("*.distcp")}
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"], files
    total = sum(files.values())
    state = weights(runs["two"], STEPS)
    params = sum(t.numel() for k, t in state.items() if not k.endswith("lm_head.weight"))
    assert total > 12 * params  # fp32 weights and AdamW's two moments, once
    for name, size in files.items():
        assert abs(size / total - 0.5) < 0.1, (name, size, total)
    # one host's 8-way chunks: one file, the same tensors
    assert len(list(Path(checkpoint.step_dir(runs["one"], STEPS)).glob("*.distcp"))) == 1


def test_a_checkpoint_moves_between_one_and_two_hosts(runs):
    """Resumed at step 3, each run ends where the uninterrupted run that wrote the checkpoint ends:
    2 -> 2 hosts bit for bit, 2 -> 1 and 1 -> 2 within 1e-5 (three steps in the other layout)."""
    one, two = weights(runs["one"], STEPS), weights(runs["two"], STEPS)
    for run, source in ((runs["on_one"], two), (runs["on_two"], one), (runs["again"], two)):
        assert checkpoint.latest_step(run) == STEPS
        assert _max_diff(weights(run, STEPS), source) < 1e-5, run
    assert _max_diff(weights(runs["again"], STEPS), two) == 0.0
    saved = checkpoint.load(runs["again"], STEPS, keys=("optimizer",))["optimizer"]
    written = checkpoint.load(runs["two"], STEPS, keys=("optimizer",))["optimizer"]
    assert _max_diff(_flat(saved), _flat(written)) == 0.0  # the optimizer state came back whole
    one_host, *hosts = runs["resumed_errs"]
    assert "resumed from step 3" in one_host
    for host0, host1 in (hosts[:2], hosts[2:]):
        assert "rank 0/2: resumed from step 3" in host0
        assert "rank 1/2: resumed from step 3" in host1


def test_the_resume_holds_the_state_sharded_within_the_plan(runs):
    """A resumed host's memory rises by what the plan says its load path holds: its chips' pieces
    of the weights and AdamW's state read on the host, then the same on its 4 chips (sharded, 1/4
    each). Loading the optimizer state whole onto every chip, as resume did before, adds 4 chips x
    8 bytes a parameter and fails this bound."""
    from codex.core.config import build_config
    from codex.train.plan.memory import Setting, plan
    from codex.train.plan.presets import get_preset

    cfg = build_config(overrides=[*base_overrides(), *MODEL, "model.vocab_size=300"])
    preset = get_preset("v4-16")
    p = plan(cfg.model, preset, 1, 16, Setting(dtype="fp32", layout="fsdp", fsdp_size=4))
    assert p.shards == 4
    chips = preset.devices_per_host
    device_side = chips * (p.weights + p.optimizer_state + p.load_buffers)
    planned = p.host_load_bytes(chips) + device_side
    bound = planned + 32 * 2**20  # the runtime's own allocations while loading
    # what resume held before: every tensor whole on the host, AdamW's state whole on every chip
    before = 12 * p.params + chips * 8 * p.params
    assert bound < before
    for host in runs["rss"]:
        rise = host["peak"] - host["rss_before"]
        assert 0 < rise <= bound, (rise, planned)


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


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
