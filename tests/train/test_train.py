"""codex train on the CPU: data parallel == grad accumulation == one big batch, exact resume after
SIGKILL, SIGTERM checkpoints, the batch arithmetic, schedules, presets, the compiled bf16 path.
Checkpoint files and retention: tests/train/checkpoint/test_checkpoint.py; metrics and wandb:
tests/train/test_metrics.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from codex.core.config import ConfigError, build_config
from codex.train.checkpoint import folders as checkpoint
from codex.train.plan.batch import grad_accum_steps
from tests.fixtures.runs import (  # noqa: F401
    KILL_AT_SAVE,
    assert_close,
    base_overrides,
    child_env,
    final_model,
    make_run,
    one_thread,
    optimizer_tensors,
    run_train,
    train_cli_args,
)

ROOT = Path(__file__).resolve().parents[2]


# --- batch arithmetic ---------------------------------------------------------------------------


def test_grad_accum_formula():
    assert grad_accum_steps(0, 4, 16, 2) == 1  # 0 = one micro-batch per step
    assert grad_accum_steps(4 * 16 * 2 * 3, 4, 16, 2) == 3
    assert grad_accum_steps(524288, 16, 1024, 8) == 4  # 0.5M tokens on 8 GPUs
    with pytest.raises(ConfigError) as e:  # 1000 is no multiple of 4*16*2 = 128
        grad_accum_steps(1000, 4, 16, 2)
    msg = str(e.value)
    assert "1024 (accum 8)" in msg and "896 (accum 7)" in msg
    assert "multiple of seq_len * world_size = 32" in msg  # 1000 % 32 != 0: no device batch fits
    with pytest.raises(ConfigError) as e:  # 3072 = 96 seqs per rank; B=5 does not divide
        grad_accum_steps(3072, 5, 16, 2)
    msg = str(e.value)
    assert "3040 (accum 19)" in msg and "3200 (accum 20)" in msg
    assert "device_batch in [3, 4, 6, 8]" in msg


def test_cli_bad_batch_tokens_exits_2(tmp_path):
    from click.testing import CliRunner

    from codex.cli.main import cli

    run = make_run(tmp_path / "run")
    result = CliRunner().invoke(
        cli,
        [
            "train",
            "--batch-tokens",
            "1000",
            "--device-batch",
            "4",
            "--seq-len",
            "16",
            *train_cli_args(run),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "train.batch_tokens=1000" in result.output and "1024 (accum 16)" in result.output
    assert not (Path(run) / "checkpoints" / "step_00000001").exists()


# --- equivalence: 1 process / 2 processes (torchrun, gloo) / grad accumulation -------------------


@pytest.mark.slow
def test_one_process_two_processes_and_accumulation_agree(tmp_path):
    """The same global batch of 8 sequences per step three ways; parameters agree after 5 steps."""
    runs = {name: make_run(tmp_path / name) for name in ("big", "accum", "ddp")}
    # lr 1e-3: at 1e-2 Adam's first steps (update ~ lr * g/|g|) amplify summation-order rounding
    # in near-zero gradients to ~3e-5 (measured); at 1e-3 the three runs agree to ~5e-8.
    steps = dict(max_steps=5, save_every=5, lr=1e-3)
    # torchrun first (a subprocess), so the in-process runs overlap nothing.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "codex.cli",
        "--",
        "train",
        *train_cli_args(runs["ddp"], device_batch=4, **steps),
    ]
    proc = subprocess.run(
        cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # really two ranks, no accumulation
    assert "x2 (cpu, 1 thread)" in proc.stderr and "accum 1" in proc.stderr

    big = run_train(runs["big"], device_batch=8, **steps)
    acc = run_train(runs["accum"], device_batch=4, batch_tokens=8 * 16, **steps)
    assert (big["accum"], acc["accum"]) == (1, 2)

    init = build_init(runs["big"])
    m_big, m_acc, m_ddp = (final_model(runs[n]) for n in ("big", "accum", "ddp"))
    assert max((m_big[k] - init[k]).abs().max().item() for k in init) > 1e-3  # it did train
    assert_close(m_big, m_acc, 1e-5)
    assert_close(m_big, m_ddp, 1e-5)
    # The logged losses are the mean over every token of the step, whichever way it was split.
    losses = {
        n: [
            json.loads(line)["loss"]
            for line in open(Path(runs[n]) / "metrics.jsonl")
            if '"train"' in line
        ]
        for n in runs
    }
    assert len(losses["big"]) == 5
    for n in ("accum", "ddp"):
        assert losses[n] == pytest.approx(losses["big"], abs=1e-5)


def build_init(run: str) -> dict:
    from codex.model.gpt import build_model

    cfg = build_config(overrides=base_overrides(), run=run)
    cfg.model.vocab_size = 300
    return {
        k: v.clone() for k, v in build_model(cfg.model, seed=cfg.train.seed).state_dict().items()
    }


# --- exact resume after SIGKILL ------------------------------------------------------------------


def _train_loss_at(run: str, step: int) -> float:
    lines = [json.loads(s) for s in Path(run, "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in lines if r["kind"] == "train" and r["step"] == step)


@pytest.mark.slow
def test_a_resume_with_another_accumulation_logs_the_loss_an_uninterrupted_run_logs(tmp_path):
    """The loss window at a checkpoint is a sum of micro-batch losses (2 a step here); resumed at
    4 micro-batches a step (device_batch 4 -> 2, the same 8 rows a step), the line at step 6
    (steps 4..6) must equal the uninterrupted run's, not count step 4's sum at the new accum."""
    keys = dict(max_steps=6, log_every=3, batch_tokens=128, lr=1e-3)
    full, split = make_run(tmp_path / "full"), make_run(tmp_path / "split")
    run_train(full, device_batch=4, **keys)
    run_train(split, device_batch=4, save_every=4, **keys)
    checkpoint.drop_newer(split, 4)  # resume from step 4, mid-window (the last line was step 3)
    out = run_train(split, device_batch=2, **keys)
    assert out["accum"] == 4
    assert abs(_train_loss_at(split, 6) - _train_loss_at(full, 6)) < 1e-4 * _train_loss_at(full, 6)


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    # accum 2
    steps = dict(max_steps=8, save_every=2, eval_every=4, device_batch=4, batch_tokens=128)
    ref_run, run = make_run(tmp_path / "ref"), make_run(tmp_path / "killed")
    ref = run_train(ref_run, **steps)

    script = KILL_AT_SAVE.format(kill_step=6, args=train_cli_args(run, **steps))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert checkpoint.latest_step(run) == 4  # step 6 has no DONE
    assert (Path(run) / "checkpoints" / "step_00000006" / "__0_0.distcp").exists()

    resumed = run_train(run, **steps)
    assert resumed["step"] == 8 and not resumed["stopped"]
    a, b = checkpoint.load(ref_run), checkpoint.load(run)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    a_opt, b_opt = optimizer_tensors(a["optimizer"]), optimizer_tensors(b["optimizer"])
    assert a_opt and a_opt.keys() == b_opt.keys()
    for key, t in a_opt.items():
        assert torch.equal(t, b_opt[key]), key
    assert a["loader"] == b["loader"] and a["tokens"] == b["tokens"] == 8 * 128
    assert resumed["val_loss"] == ref["val_loss"]
    # metrics.jsonl reads like one run: the killed run's lines after step 4 were dropped, not
    # doubled.
    recs = [json.loads(line) for line in open(Path(run) / "metrics.jsonl")]
    assert [r["step"] for r in recs if r["kind"] == "train"] == list(range(1, 9))
    ref_recs = [json.loads(line) for line in open(Path(ref_run) / "metrics.jsonl")]
    assert [r["loss"] for r in recs if r["kind"] == "train"] == [
        r["loss"] for r in ref_recs if r["kind"] == "train"
    ]
    # Retention (keep_last=3) removed the oldest, and the half-written step 6 was replaced.
    assert checkpoint.complete_steps(run) == [4, 6, 8]
    # Every checkpoint's non-tensor part is plain JSON with the contract's keys (tensors: DCP
    # files).
    raw = json.loads((Path(run) / "checkpoints" / "step_00000008" / "state.json").read_text())
    assert {
        "model",
        "optimizer",
        "step",
        "tokens",
        "loader",
        "rng",
        "config",
        "codex_version",
    } <= raw.keys()
    assert raw["config"]["train"]["max_steps"] == 8 and raw["step"] == 8


# --- SIGTERM: finish the step, save, exit 0 ------------------------------------------------------


def sigterm_after_three_steps(proc: subprocess.Popen, metrics: Path, timeout: float) -> str:
    """Once the run has logged 3 lines, SIGTERM it; its stderr after it exits."""
    deadline = time.time() + timeout
    while time.time() < deadline and (
        not metrics.exists() or len(metrics.read_text().splitlines()) < 3
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=timeout)[1]


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path):
    run = make_run(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "codex.cli", "train", *train_cli_args(run, max_steps=100_000)],
        env=child_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = Path(run) / "metrics.jsonl"
    err = sigterm_after_three_steps(proc, metrics, timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM" in err and "Resume: run the same command again" in err
    step = checkpoint.latest_step(run)
    assert step is not None and 3 <= step < 100_000
    last_logged = [json.loads(line) for line in metrics.read_text().splitlines()][-1]["step"]
    assert last_logged == step  # the step in flight finished, then saved
    state = checkpoint.load(run)
    assert state["step"] == step and state["tokens"] == step * 64


@pytest.mark.slow
def test_sigterm_under_torchrun_stops_every_rank_at_the_same_step(tmp_path):
    """torchrun forwards SIGTERM to every worker; the ranks agree on the stop step (a host-side
    flag all-reduce), rank 0 saves, the workers exit 0. torchrun itself then reports the signal."""
    run = make_run(tmp_path / "run")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "codex.cli",
            "--",
            "train",
            *train_cli_args(run, max_steps=100_000),
        ],
        env=child_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = Path(run) / "metrics.jsonl"
    err = sigterm_after_three_steps(proc, metrics, timeout=120)
    assert err.count("SIGTERM received") == 2, err[-3000:]  # both workers got it
    assert "checkpoint (preempted)" in err and "Resume: run the same command again" in err
    step = checkpoint.latest_step(run)
    last_logged = [json.loads(line) for line in metrics.read_text().splitlines()][-1]["step"]
    assert step is not None and step == last_logged and checkpoint.load(run)["tokens"] == step * 128


# --- checkpoints ---------------------------------------------------------------------------------


# --- wandb offline -------------------------------------------------------------------------------


# --- schedule, parameter groups, presets, backend errors -----------------------------------------


def test_lr_schedules():
    from codex.train.optim.schedule import lr_at

    kw = dict(max_lr=1.0, total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1) and lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0) and lr_at(99, **kw) == pytest.approx(0.1)
    mid = 10 + (99 - 10) / 2
    assert lr_at(int(mid), **kw) == pytest.approx(0.55, abs=0.02)
    c = [lr_at(s, **kw) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(c, c[1:], strict=False))  # cosine never goes up
    w = dict(kw, schedule="wsd", decay_fraction=0.2)
    assert [lr_at(s, **w) for s in (10, 50, 79)] == [1.0, 1.0, 1.0]
    assert lr_at(80, **w) < 1.0 and lr_at(99, **w) == pytest.approx(0.1)


def test_no_weight_decay_on_norms_embeddings_and_vectors():
    from codex.model.gpt import build_model
    from codex.train.optim.optimizer import param_groups

    cfg = build_config(overrides=base_overrides())
    cfg.model.vocab_size = 300
    model = build_model(cfg.model, seed=0)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert "wte.weight" in nd and "norm_f.weight" in nd and "blocks.0.attn.q_norm.weight" in nd
    assert (
        "lm_head.weight" in d
        and "blocks.0.attn.c_q.weight" in d
        and "blocks.1.mlp.w_down.weight" in d
    )
    assert all(model.get_parameter(n).ndim == 2 for n in d)
    assert len(d) + len(nd) == len(list(model.parameters()))


def test_hardware_presets_and_table():
    from codex.train.plan.presets import get_preset
    from codex.train.plan.report import format_hardware_table

    table = format_hardware_table()
    for name in (
        "cpu",
        "a100",
        "h100-8",
        "h200",
        "v4-8",
        "v5litepod-16",
        "v5p-8",
        "v6e-1",
        "v6e-16",
    ):
        assert f"\n{name} " in table
    assert get_preset("v5p-8").devices == 4 and get_preset("v6e-8").devices == 8
    p = get_preset("v6e-16")
    assert (p.hosts, p.devices_per_host, p.peak_flops) == (4, 4, 918e12)
    assert get_preset("h100-4").devices_per_host == 4 and get_preset("h200").peak_flops == 989e12
    with pytest.raises(ConfigError, match="did you mean 'h100'"):
        get_preset("h10")


def test_cuda_preset_without_cuda_fails_naming_the_fix(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from codex.train.distributed.backend import BackendError
    from codex.train.launch import make_backend

    cfg = build_config(overrides=base_overrides(hardware="h100-8"), run=str(tmp_path))
    with pytest.raises(BackendError) as e:
        make_backend(cfg)
    assert "needs CUDA" in str(e.value) and "--hardware cpu" in str(e.value)


@pytest.mark.slow
def test_default_batch_comes_from_the_preset(tmp_path):
    from codex.train.plan.batch import device_defaults
    from codex.train.plan.presets import get_preset

    cfg = build_config(model="124m")
    assert device_defaults(get_preset("h200-8"), cfg.model) == (64, 1024)
    # by the memory plan (flash attention, the TPU default: no T x T probabilities)
    assert device_defaults(get_preset("v5litepod-4"), cfg.model) == (8, 1024)
    with pytest.raises(ConfigError, match="does not fit"):
        device_defaults(get_preset("v5litepod-4"), build_config(model="1b").model)  # replicated
    run = make_run(tmp_path / "run")
    # a custom model shape: the 'default' entry, 4 sequences a micro-batch, 8,192 tokens a step
    out = run_train(run, device_batch=0, max_steps=1)
    assert (out["device_batch"], out["seq_len"], out["batch_tokens"]) == (4, 16, 8192)
    assert out["accum"] == 8192 // (4 * 16)


# --- the CUDA code path's torch.compile + bf16 autocast, run on the CPU ---------------------------


@pytest.mark.slow
def test_compiled_bf16_training_matches_eager_and_resumes(tmp_path, monkeypatch):
    """On CUDA the backend wraps the model in torch.compile and runs it under bf16 autocast. This
    runs that same wrapper and loop on the CPU (inductor's C++ backend): losses match eager bf16,
    checkpoints hold plain keys (no '_orig_mod.'), and a resumed compiled run ends where an
    uninterrupted one does. (~1 min: inductor compiles the model once per process.)"""
    import codex.train.launch as B

    real = B.make_backend

    def cpu_like_cuda(cfg, **kwargs):
        b = real(cfg, **kwargs)
        b.compile = bool(cfg.train.compile)
        b.autocast_dtype = torch.bfloat16
        return b

    monkeypatch.setattr(B, "make_backend", cpu_like_cuda)
    # warmup ends and the decay runs within the 6 steps, with a validation at 3 and 6
    steps = dict(max_steps=6, save_every=3, eval_every=3, warmup_steps=2)
    eager_run, compiled_run = make_run(tmp_path / "eager"), make_run(tmp_path / "compiled")
    eager = run_train(eager_run, compile=False, **steps)
    compiled = run_train(compiled_run, compile=True, **steps)
    # the learning rate (warmup, decay) and validation (the uncompiled module) never recompile:
    # dynamo's graph count, logged on every line, is the same from the first line to the last
    counts = [
        json.loads(line).get("compiles")
        for line in open(Path(compiled_run) / "metrics.jsonl")
        if '"kind": "train"' in line
    ]
    assert counts[0] is not None and len(set(counts)) == 1, counts

    def losses(run):
        return [
            json.loads(line)["loss"]
            for line in open(Path(run) / "metrics.jsonl")
            if '"kind": "train"' in line
        ]

    e, c = losses(eager_run), losses(compiled_run)
    assert len(e) == len(c) == 6
    # bf16 kernels differ (~2e-3), the run does not
    assert max(abs(a - b) for a, b in zip(e, c, strict=True)) < 0.01, (
        e,
        c,
    )
    assert abs(eager["val_loss"] - compiled["val_loss"]) < 0.01
    final = checkpoint.load(compiled_run, "latest")
    assert final["step"] == 6 and not [k for k in final["model"] if "_orig_mod" in k]
    assert final["model"].keys() == checkpoint.load(eager_run, "latest")["model"].keys()

    # Lose the final checkpoint; the rerun resumes at step 3 into a compiled model and ends the
    # same.
    import shutil

    shutil.rmtree(Path(compiled_run) / "checkpoints" / "step_00000006")
    resumed = run_train(compiled_run, compile=True, **steps)
    assert resumed["step"] == 6 and resumed["tokens"] == compiled["tokens"]
    assert_close(final["model"], checkpoint.load(compiled_run, "latest")["model"], atol=1e-6)


@pytest.mark.slow
def test_resumed_loss_curve_equals_the_uninterrupted_one(tmp_path):
    """The loss logged after a resume averages the same window as the uninterrupted run: the
    partial window (loss sum and its first step) travels in the checkpoint."""
    import shutil

    def losses(run):
        recs = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}

    full = make_run(tmp_path / "full")
    run_train(full, max_steps=10, log_every=4, save_every=6, keep_last=5)
    resumed = str(tmp_path / "resumed")
    shutil.copytree(full, resumed)
    shutil.rmtree(checkpoint.step_dir(resumed, 10))  # as if killed after the step-6 checkpoint
    out = run_train(resumed, max_steps=10, log_every=4, save_every=6, keep_last=5)
    assert out["step"] == 10
    a, b = losses(full), losses(resumed)
    assert sorted(a) == sorted(b) == [4, 8, 10]
    assert b[8] == a[8] and b[10] == a[10]  # step 8 averages steps 5-8, across the resume
    # below the checkpoint: says so, trains nothing
    again = run_train(resumed, max_steps=6, log_every=4)
    assert again["step"] == 10 and not again["stopped"]


@pytest.mark.slow
def test_train_threads_sets_the_threads_a_cpu_run_uses(tmp_path):
    """train.threads=2 overrides OMP_NUM_THREADS=1 (set in the child), and the start-up lines say
    how many threads the run uses and why."""
    run = make_run(tmp_path / "run")
    args = train_cli_args(run, max_steps=1, threads=2)
    proc = subprocess.run(
        [sys.executable, "-m", "codex.cli", "train", *args],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cpu x1 (cpu, 2 threads)" in proc.stderr
    assert "threads: 2 CPU threads per process (train.threads)" in proc.stderr


def test_the_loop_turns_gc_off_and_collects_the_young_generations_every_gc_every_steps(
    tmp_path, monkeypatch
):
    """train.gc_every=2 over 5 steps (torchtitan's GarbageCollection): one full collection as
    training starts, with the collector off from then on, and one after the first step (the end of
    start-up, whose objects are then frozen); gc.collect(1) after steps 2 and 4, never an
    automatic one; the collector back on at the end. gc_every=0 leaves it alone."""
    import gc

    calls = []
    collect = gc.collect

    def counted(generation: int = 2) -> int:
        calls.append((generation, gc.isenabled()))
        return collect(generation)

    monkeypatch.setattr(gc, "collect", counted)
    assert gc.isenabled()
    run_train(make_run(tmp_path / "managed"), max_steps=5, gc_every=2)
    assert calls == [(2, False), (2, False), (1, False), (1, False)]
    assert gc.isenabled()
    calls.clear()
    run_train(make_run(tmp_path / "automatic"), max_steps=5, gc_every=0)
    assert calls == [] and gc.isenabled()


def test_start_up_objects_are_collected_once_then_frozen():
    """The managed collector ends start-up with one full collection and gc.freeze(): the objects
    start-up made (torch.compile's tracing above all) are never traversed again, so the first
    steady collection (step gc_every) has only the steps' own garbage to look at. close() gives
    the collector back as it was."""
    import gc

    from codex.train.loop import ManagedGC

    was = gc.isenabled()
    collector = ManagedGC(50)
    try:
        assert not gc.isenabled()
        start_up = [{"i": i} for i in range(20_000)]  # long-lived objects made during start-up
        collector.start_up_done()
        assert gc.get_freeze_count() >= len(start_up)
        assert gc.get_count()[0] < 1_000
    finally:
        collector.close()
    assert gc.get_freeze_count() == 0 and gc.isenabled() == was
