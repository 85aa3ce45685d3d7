"""The TPU path (train/xla/backend.py) for real on the XLA CPU backend (PJRT_DEVICE=CPU).

Run in the XLA venv:  PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla
tests/train/xla/test_xla.py

One XLA runtime per process, so every device count runs in its own subprocess (conftest.run_xla),
and the eager reference runs in a subprocess of the same venv without torch_xla. XLA compiles
cost ~10-20 s each on a loaded 2-core machine, so a few processes do all the runs and the tests
share them:

    eager      (no XLA)        30 steps (checkpoint every 5) and 5 steps: the references
    spmd_a     (4 devices)     30 steps, validation every 10 -> compile count; resume an eager
                               checkpoint; SPMD eval vs eager eval; the max_compiles error
    spmd_b     (4 devices)     60 steps -> the same compile count; a device-count mismatch error
    muon       (eager, 4 dev.) train.optimizer=muon: 30 steps each (parity, no new program
                               after step 10); its own fixture, so it can run alone
    spawn      (1 device)      --xla-mode spawn, XLA_ALWAYS_ALLREDUCE=1, 5 steps,
                               train.xla_step=traced (the Python micro-batch loop; every other
                               run uses the cached While)
    eager_resume (no XLA)      resume the SPMD checkpoint on the eager CPU path

Every run uses the tiny model preset, seq_len 32, 512 tokens a step with gradient accumulation 2
(SPMD: device_batch 2 x 4 devices x accum 2; eager: device_batch 8 x 1 x accum 2: the same
global batches in the same order), fp32 (the CPU has no fast bf16 and 1e-4 needs fp32).
lr 1e-3: XLA's fp32 kernels differ from eager's by ~1e-7 relative (losses agree to 5e-7), and
Adam's first steps turn that into lr-sized updates where a gradient entry is near zero; at
lr 1e-2 the largest parameter difference after 5 steps was 7e-4 (4.5e-4 with spawn on one
device, so it is the kernels, not the sharding).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.fixtures import ROOT
from tests.fixtures.procs import run_xla
from tests.fixtures.runs import child_env, make_run
from tests.fixtures.xla import (  # noqa: F401
    EXPECTED_COMPILES,
    PRELUDE,
    max_diff,
    model_at,
    overrides,
    results,
    run_eager,
    run_xla_script,
)

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file, once. Returns {name: results}, plus the run directories."""
    root = tmp_path_factory.mktemp("xla")
    make_run(root / "data")
    d = {
        name: str(root / name)
        for name in (
            "eager30",
            "eager5",
            "spmd30",
            "spmd60",
            "spawn5",
            "resume_xla",
            "resume_eager_from_xla",
            "resume_eager_from_eager",
        )
    }
    for _name, path in d.items():  # identical data in every run directory
        shutil.copytree(root / "data", path)
    out: dict = {"dirs": d}

    out.update(
        run_eager(f"""
emit("eager30", train(cfg({d["eager30"]!r}, {overrides("cpu", 8, 30, save_every=5)!r}), evaluate))
emit("eager5", train(cfg({d["eager5"]!r}, {overrides("cpu", 8, 5)!r}), evaluate))
""")
    )
    # The XLA run that resumes an eager checkpoint starts from eager30's step 25.
    shutil.copytree(
        Path(d["eager30"]) / "checkpoints" / "step_00000025",
        Path(d["resume_xla"]) / "checkpoints" / "step_00000025",
    )

    spmd_a = f"""
import torch_xla.debug.metrics as met
r = train(cfg({d["spmd30"]!r}, {overrides("v6e-4", 2, 30, save_every=5)!r}), evaluate)
emit("spmd30", r)
emit("spmd30_compiles", met.metric_data("CompileTime")[0])
emit("spmd30_metrics",
     [json.loads(l) for l in open(os.path.join({d["spmd30"]!r}, "metrics.jsonl"))])

# An eager checkpoint (step 25) resumes on XLA and finishes the run (steps 26..30).
emit("resume_xla", train(cfg({d["resume_xla"]!r}, {overrides("v6e-4", 2, 30, save_every=5)!r}),
                         evaluate))

# eval.evaluate: one set of weights (eager30 step 30), SPMD over 4 devices vs the eager CPU.
from codex.eval.evaluate import evaluate
from codex.model.gpt import build_model
from codex.train.checkpoint import folders as checkpoint
from codex.train.distributed.backend import loader_layout
from codex.train.launch import make_backend
from codex.train.data.loader import val_batches
import numpy as np
c = cfg({d["eager30"]!r}, {overrides("v6e-4", 2, 30)!r})
state = checkpoint.load(c.run, 30)
c.model.vocab_size = state["config"]["model"]["vocab_size"]
tb = torch.from_numpy(
    np.load(os.path.join(c.run, "tokenizer", "token_bytes.npy")).astype("int64"))
shards = os.path.join(c.run, "shards")
cpu_model = build_model(c.model, seed=0); cpu_model.load_state_dict(state["model"])
eager = evaluate(cpu_model, val_batches(shards, seq_len=32, batch_size=8), tb)
backend = make_backend(c)
xla_model = build_model(c.model, seed=0); xla_model.load_state_dict(state["model"])
xla_model = backend.prepare_model(xla_model)
rank, world, rows = loader_layout(backend, 2)
# 20 windows of 32 tokens = 3 batches of 8 rows, the last one masked: fixed shapes on XLA.
xla = evaluate(xla_model, val_batches(shards, seq_len=32, batch_size=rows, rank=rank,
                                      world_size=world, max_tokens=640, with_mask=True),
               tb, backend=backend)
eager_640 = evaluate(cpu_model, val_batches(shards, seq_len=32, batch_size=8, max_tokens=640), tb)
emit("eval", {{"eager_all": eager, "xla": xla, "eager": eager_640, "layout": [rank, world, rows]}})

# max_compiles fails loudly.
from codex.train.xla.backend import CompileLimitError
backend.max_compiles = backend.compile_count() - 1
try:
    backend.step_boundary()
    emit("max_compiles_error", None)
except CompileLimitError as e:
    emit("max_compiles_error", str(e))
"""
    spmd_b = f"""
import torch_xla.debug.metrics as met
from codex.train.distributed.backend import BackendError
from codex.train.launch import make_backend
try:
    make_backend(cfg({d["spmd60"]!r}, {overrides("v6e-8", 2, 60)!r}))
    emit("mismatch_error", None)
except BackendError as e:
    emit("mismatch_error", str(e))
emit("spmd60", train(cfg({d["spmd60"]!r}, {overrides("v6e-4", 2, 60)!r}), evaluate))
emit("spmd60_compiles", met.metric_data("CompileTime")[0])
"""
    spawn = f"""
import functools
from codex.train.xla.backend import spawn_train
emit("spawn5", spawn_train(
    cfg({d["spawn5"]!r},
        {overrides("v6e-1", 8, 5, xla_mode="spawn", xla_step="traced")!r}),
    functools.partial(train, evaluate=evaluate)))
"""
    # Three independent XLA processes at once: compiles are mostly single-threaded.
    with ThreadPoolExecutor(3) as pool:
        jobs = [
            pool.submit(run_xla_script, spmd_a, 4),
            pool.submit(run_xla_script, spmd_b, 4),
            pool.submit(run_xla_script, spawn, 1, {"XLA_ALWAYS_ALLREDUCE": "1"}),
        ]
        for j in jobs:
            out.update(j.result())

    # The SPMD checkpoint (step 30) resumes on the eager CPU path; so does the eager one, for
    # reference.
    for src, dst in (("spmd30", "resume_eager_from_xla"), ("eager30", "resume_eager_from_eager")):
        shutil.copytree(
            Path(d[src]) / "checkpoints" / "step_00000030",
            Path(d[dst]) / "checkpoints" / "step_00000030",
        )
    out.update(
        run_eager(f"""
emit("resume_eager_from_xla",
     train(cfg({d["resume_eager_from_xla"]!r}, {overrides("cpu", 8, 35)!r}), evaluate))
emit("resume_eager_from_eager",
     train(cfg({d["resume_eager_from_eager"]!r}, {overrides("cpu", 8, 35)!r}), evaluate))
""")
    )
    return out


def test_spmd_4_devices_matches_eager_after_5_steps(runs):
    d = runs["dirs"]
    assert runs["spmd30"]["world_size"] == 4 and runs["spmd30"]["accum"] == 2
    assert runs["eager30"]["world_size"] == 1 and runs["eager30"]["accum"] == 2
    diff = max_diff(model_at(d["spmd30"], 5), model_at(d["eager30"], 5))
    assert diff < 1e-4, f"SPMD vs eager after 5 steps: max abs diff {diff:.3g}"
    # The weights really moved (a no-op step would also "match").
    assert max_diff(model_at(d["spmd30"], 5), model_at(d["spmd30"], 10)) > 1e-3
    # And the whole 30-step run stays on the eager trajectory.
    assert max_diff(model_at(d["spmd30"], 30), model_at(d["eager30"], 30)) < 1e-4
    assert abs(runs["spmd30"]["val_loss"] - runs["eager30"]["val_loss"]) < 1e-4


def test_compile_count_is_fixed(runs):
    assert runs["spmd30_compiles"] == EXPECTED_COMPILES
    assert runs["spmd60_compiles"] == EXPECTED_COMPILES  # twice the steps, no new program
    logged = [m["compiles"] for m in runs["spmd30_metrics"] if m.get("kind") == "train"]
    assert logged and logged[-1] <= EXPECTED_COMPILES and logged == sorted(logged)
    # The learning rate changed every step (warmup + cosine) without a recompile.
    lrs = [m["lr"] for m in runs["spmd30_metrics"] if m.get("kind") == "train"]
    assert len(set(lrs)) == len(lrs) > 3
    err = runs["max_compiles_error"]
    assert err and "max_compiles" in err and "PT_XLA_DEBUG_LEVEL" in err


def test_spawn_one_device_with_all_reduce_matches_eager(runs):
    # Also train.xla_step=traced: the re-traced Python micro-batch loop still trains the same model.
    d = runs["dirs"]
    assert runs["spawn5"]["step"] == 5 and runs["spawn5"]["world_size"] == 1
    diff = max_diff(model_at(d["spawn5"], 5), model_at(d["eager5"], 5))
    assert diff < 1e-4, f"spawn vs eager: max abs diff {diff:.3g}"


def test_xla_checkpoint_resumes_on_eager_cpu_and_back(runs):
    d = runs["dirs"]
    # A DCP checkpoint like every other: loads into CPU tensors without torch_xla.
    from codex.train.checkpoint import folders as checkpoint

    state = checkpoint.load(d["spmd30"], 30)
    parts = list(state["optimizer"].values())  # AdamW, or Muon + AdamW
    tensors = list(state["model"].values()) + [
        v
        for part in parts
        for s in part["state"].values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    # XLA -> eager: 5 more steps from the SPMD checkpoint follow the eager continuation.
    a, b = runs["resume_eager_from_xla"], runs["resume_eager_from_eager"]
    assert a["step"] == b["step"] == 35
    assert (
        max_diff(
            model_at(d["resume_eager_from_xla"], 35), model_at(d["resume_eager_from_eager"], 35)
        )
        < 1e-4
    )
    assert abs(a["loss"] - b["loss"]) < 1e-4
    # eager -> XLA: SPMD resumed eager30's step 25 and ended where eager30 ended.
    assert runs["resume_xla"]["step"] == 30
    diff = max_diff(model_at(d["resume_xla"], 30), model_at(d["eager30"], 30))
    assert diff < 1e-4, f"eager checkpoint resumed on XLA vs eager: max abs diff {diff:.3g}"


def test_spmd_eval_matches_eager_eval(runs):
    ev = runs["eval"]
    assert ev["layout"] == [0, 1, 8]  # one loader on this host, feeding 4 devices x 2 rows
    xla, eager = ev["xla"], ev["eager"]
    assert xla["tokens"] == eager["tokens"] == 640 and xla["bytes"] == eager["bytes"] > 0
    assert abs(xla["loss"] - eager["loss"]) < 1e-5
    assert abs(xla["bits_per_byte"] - eager["bits_per_byte"]) < 1e-5
    assert eager["tokens"] < ev["eager_all"]["tokens"]  # the mask dropped the filler rows, no more


def test_device_count_mismatch_is_an_error(runs):
    err = runs["mismatch_error"]
    assert (
        err
        and "v6e-8" in err
        and "8 chips" in err
        and "found 4 devices" in err
        and "CPU_NUM_DEVICES" in err
    )


NO_FALLBACK = f"""
import os, sys, json
sys.path.insert(0, {str(ROOT)!r})
from codex.core.config import build_config
from codex.train.distributed.backend import BackendError
from codex.train.launch import make_backend
out = {{}}
for case, env, allow in (("unset", None, True), ("cpu_not_allowed", "CPU", False),
                         ("tpu_missing", "TPU", True)):
    os.environ.pop("PJRT_DEVICE", None)
    if env:
        os.environ["PJRT_DEVICE"] = env
    cfg = build_config(overrides=["train.hardware=v6e-4",
                                  f"train.allow_cpu_xla={{str(allow).lower()}}"])
    try:
        make_backend(cfg)
        out[case] = None
    except BackendError as e:
        out[case] = str(e)
os.environ["PJRT_DEVICE"] = "CPU"
try:
    make_backend(build_config(overrides=["train.hardware=v6e-4", "train.allow_cpu_xla=true",
                                         "model.attention=flash"]))
    out["flash_on_cpu"] = None
except BackendError as e:
    out["flash_on_cpu"] = str(e)
sys.modules["torch_xla"] = None  # as in a venv without torch_xla
try:
    make_backend(build_config(overrides=["train.hardware=v6e-4"]))
    out["no_torch_xla"] = None
except BackendError as e:
    out["no_torch_xla"] = str(e)
print("RESULT " + json.dumps(out))
print("RUNTIME", "torch_xla._XLAC" in sys.modules
      and sys.modules["torch_xla._XLAC"]._xla_runtime_is_initialized())
"""


def test_no_silent_fallback():
    proc = run_xla(NO_FALLBACK, devices=1)
    out = results(proc)
    assert "PJRT_DEVICE=(unset)" in out["unset"] and "export PJRT_DEVICE=TPU" in out["unset"]
    assert "TPU chip(s)" in out["unset"] and "v6e-4" in out["unset"]
    assert (
        "PJRT_DEVICE=CPU" in out["cpu_not_allowed"] and "--allow-cpu-xla" in out["cpu_not_allowed"]
    )
    assert "PJRT_DEVICE=TPU" in out["tpu_missing"] and "0 TPU chip(s)" in out["tpu_missing"]
    assert (
        "torch_xla cannot be imported" in out["no_torch_xla"]
        and "pip install" in out["no_torch_xla"]
    )
    assert "model.attention=flash" in out["flash_on_cpu"] and "TPU preset" in out["flash_on_cpu"]
    assert "PJRT_DEVICE=CPU runs the XLA path on the CPU" in out["flash_on_cpu"]
    assert "RUNTIME False" in proc.stdout  # refused before the XLA runtime started


def test_cli_refuses_tpu_preset_without_tpu(tmp_path):
    """`codex train --hardware v6e-4` with PJRT_DEVICE unset fails and names the fix."""
    run = make_run(tmp_path / "run")
    env = child_env()
    env.pop("PJRT_DEVICE", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "codex.cli",
            "train",
            "--run",
            run,
            "--hardware",
            "v6e-4",
            "--model",
            "tiny",
            "--max-steps",
            "1",
            "--wandb",
            "off",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT),
    )
    assert proc.returncode != 0
    assert "PJRT_DEVICE=(unset)" in proc.stderr and "export PJRT_DEVICE=TPU" in proc.stderr
    assert not (Path(run) / "checkpoints").exists() or not any(
        (Path(run) / "checkpoints").glob("step_*")
    )


# --- a long run: the compile count stays fixed for 1,000 steps ------------------------------------

# Programs a run without validation compiles, fresh or resumed (measured): the first step (AdamW
# creates its state inside the graph; a resumed run instead converts the loaded step counters
# once), the steady step, a log step (its mean loss is computed in its own program: lagged_logs),
# and one more that is not identified (the same run started by hand outside pytest compiled 3).
# Before the lagged logs the four were: first, steady, the loss read at a log step, zeroing the
# loss sum. Before AdamW was capturable on XLA, step ~325 compiled a fifth (1 - 0.95**step became
# the special scalar 1.0).
LONG_RUN_COMPILES = 4


def _long_overrides(steps: int, **extra) -> list[str]:
    # Tiny shapes make 1,000 steps cheap (~50 s on 2 cores); every step still runs the full program.
    t = {
        "hardware": "v6e-4",
        "device_batch": 1,
        "seq_len": 8,
        "batch_tokens": 32,
        "max_steps": steps,
        "warmup_steps": 2,
        "lr": 1e-3,
        "log_every": 50,
        "eval_every": 0,
        "save_every": 500,
        "keep_last": 5,
        "wandb": "off",
        "dtype": "fp32",
        "allow_cpu_xla": True,
    }
    t.update(extra)
    return [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_kv_head=1",
        "model.n_embd=32",
        "model.max_seq_len=16",
    ] + [f"train.{k}={v}" for k, v in t.items()]


@pytest.mark.heavy  # 1,000 steps on the XLA CPU backend, a minute on 2 cores
def test_compile_count_fixed_for_1000_steps_and_after_a_resume(tmp_path):
    fresh, resumed = str(tmp_path / "fresh"), str(tmp_path / "resumed")
    make_run(Path(fresh))
    long_run = f"""
import torch_xla.debug.metrics as met
from codex.core.config import build_config
r = train(build_config(overrides={_long_overrides(1000, max_compiles=LONG_RUN_COMPILES)!r},
                       run={fresh!r}), evaluate)
emit("fresh", r)
emit("fresh_compiles", met.metric_data("CompileTime")[0])
"""
    out = run_xla_script(long_run, 4)
    assert out["fresh"]["step"] == 1000  # --max-compiles at the exact count passes the whole run
    logged = {
        m["step"]: m
        for m in map(json.loads, open(Path(fresh) / "metrics.jsonl"))
        if m["kind"] == "train"
    }
    assert [logged[s]["compiles"] for s in (50, 500, 1000)] == [LONG_RUN_COMPILES] * 3
    assert out["fresh_compiles"] == LONG_RUN_COMPILES

    # Resume from the step-500 checkpoint in a new process: no more programs than the fresh run.
    shutil.copytree(fresh, resumed, ignore=shutil.ignore_patterns("step_00001000", "xla_cache"))
    resume = f"""
import torch_xla.debug.metrics as met
from codex.core.config import build_config
emit("resumed", train(build_config(overrides={_long_overrides(1000)!r}, run={resumed!r}), evaluate))
emit("resumed_compiles", met.metric_data("CompileTime")[0])
"""
    out = run_xla_script(resume, 4)
    assert out["resumed"]["step"] == 1000
    assert out["resumed_compiles"] == LONG_RUN_COMPILES
    relogged = {
        m["step"]: m
        for m in map(json.loads, open(Path(resumed) / "metrics.jsonl"))
        if m["kind"] == "train"
    }
    # The resumed half logs the same losses as the uninterrupted run.
    for s in (550, 1000):
        assert relogged[s]["loss"] == pytest.approx(logged[s]["loss"], rel=1e-5)


MUON = dict(optimizer="muon", save_every=5)


@pytest.fixture(scope="module")
def muon_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("xla_muon")
    d = {name: str(root / name) for name in ("eager", "spmd")}
    for path in d.values():
        make_run(Path(path))
    out = {"dirs": d}
    out.update(
        run_eager(f"""
emit("eager", train(cfg({d["eager"]!r}, {overrides("cpu", 8, 30, **MUON)!r}), evaluate))
""")
    )
    out.update(
        run_xla_script(
            f"""
emit("spmd", train(cfg({d["spmd"]!r}, {overrides("v6e-4", 2, 30, **MUON)!r}), evaluate))
emit("spmd_metrics", [json.loads(l) for l in open(os.path.join({d["spmd"]!r}, "metrics.jsonl"))])
""",
            4,
        )
    )
    return out


def test_muon_spmd_matches_eager_and_compiles_no_new_program_after_warmup(muon_runs):
    d = muon_runs["dirs"]
    for step in (5, 30):
        diff = max_diff(model_at(d["spmd"], step), model_at(d["eager"], step))
        assert diff < 1e-4, f"Muon SPMD vs eager after {step} steps: max abs diff {diff:.3g}"
    assert max_diff(model_at(d["spmd"], 5), model_at(d["spmd"], 10)) > 1e-3  # it trained
    # The orthogonalisation runs inside the step's graph: once the first step, the loss read-back
    # and the validation graphs exist (step 10), the count logged every 5 steps stays put to step
    # 30.
    logged = {
        m["step"]: m["compiles"] for m in muon_runs["spmd_metrics"] if m.get("kind") == "train"
    }
    assert [logged[s] for s in (15, 20, 25, 30)] == [logged[15]] * 4, logged


REMAT = """
import json
import torch
torch.set_num_threads(1)
import torch_xla
from codex.core.config.model import ModelConfig
from codex.model.gpt import build_model
from codex.train.remat import apply_remat

cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=300, max_seq_len=16)
g = torch.Generator().manual_seed(1)
x, y = torch.randint(0, 300, (2, 16), generator=g), torch.randint(0, 300, (2, 16), generator=g)
out = {}
for remat in ("none", "block"):
    model = apply_remat(build_model(cfg, seed=0), remat, "tpu").to(torch_xla.device())
    model(x.to(torch_xla.device()), y.to(torch_xla.device())).backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([p.grad for p in model.parameters()])
    # one program for every gradient (a .cpu() per pending tensor compiles one each)
    torch_xla.sync()
    out[remat] = {"grads": {n: p.grad.cpu().tolist() for n, p in model.named_parameters()},
                  "barriers": hlo.count("opt-barrier")}
print("RESULT " + json.dumps(out))
"""


def test_remat_block_same_gradients_on_xla():
    """train.remat=block on XLA uses torch_xla's checkpoint: the same gradients (fp32, 1e-6), and
    the backward graph holds the optimization barriers that stop XLA's CSE from merging the
    recomputation back into the forward (plain torch.utils.checkpoint would leave none)."""
    out = results(run_xla(REMAT, devices=1, env={"OMP_NUM_THREADS": "1"}))
    plain, remat = out["none"], out["block"]
    assert plain["barriers"] == 0 and remat["barriers"] > 0
    assert plain["grads"].keys() == remat["grads"].keys()
    for name, g in plain["grads"].items():
        assert (torch.tensor(g) - torch.tensor(remat["grads"][name])).abs().max().item() <= 1e-6, (
            name
        )
