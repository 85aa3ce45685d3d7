"""The XLA step's host cost: host ms per optimizer step and compile seconds, side by side in one
run, for three ways to build the step:

    traced      train.xla_step=traced: the Python micro-batch loop and the optimizer, re-traced
                every step
    fb-cached   forward + backward as one While traced once (train/xla/step.py), the optimizer
                (clip + step) still traced every step: the cached step before the optimizer was
                cached too
    cached      train.xla_step=cached, the default: the While and the optimizer update
                (train/xla/update.py) both traced once

    PJRT_DEVICE=CPU .venv-xla/bin/python bench/bench_xla.py [--models tiny,124m,1b] [--accums 1,8]

Every configuration runs in its own process (one XLA runtime, fresh compile metrics) on the v6e-4
mesh (4 XLA CPU devices), with the model's layers, heads, vocab (32768) and optimizer (the default,
Muon + AdamW), the layout the memory plan picks for the preset's default batch,
and the real step code (the backend's to_device, device_accumulation, clip, optimizer). Only the
tokens are cut, to 1 sequence of 64 per device: tracing and compiling see the same operations at
any batch shape, and the CPU has to execute every step. 1b is also narrowed (16 layers, 32 query /
8 K/V heads, tied, as 1b, but 512 wide with MLP 2048 instead of 2048 / 8192): its Muon step at
full width would take the CPU ~25 minutes a step. Its trace sees the same operations; its
compile time is not 1b's, and the narrowed model fits replicated, so it runs replicated where
the real 1b on v6e-4 would be sharded (fsdp over 4: `codex hardware --model 1b`).

Optimizer ms: the host time of clip + optimizer.step (traced, fb-cached) or of the cached
update's call (cached), the median over the timed steps.

Host ms per step: Python time from the learning-rate update to the return of the step's
torch_xla.sync() (trace, batch transfer, graph hashing, dispatch), the median over the timed
steps, after two warm-up steps that compile. The device is idle at the start of every timed step
(the bench waits for it in between), and where the CPU client runs the program inside the sync,
its ExecuteReplicatedTime is taken out. Compile seconds: torch_xla's CompileTime, summed over the
whole run (every program of the run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, statistics, sys, time
from dataclasses import replace
sys.path.insert(0, {root!r})
import torch
from codex.core.config import build_config
from codex.model.gpt import mlp_hidden
from codex.train.distributed.backend import unwrap
from codex.train.plan.presets import get_preset
from codex.train.plan.plan import make_plan
from codex.train.optim.optimizer import clip_grad_norm, make_optimizer
from codex.train.optim.schedule import set_lr
from codex.train.xla.backend import make_xla_backend
import torch_xla, torch_xla.core.xla_model as xm, torch_xla.debug.metrics as met

name, accum, step_mode, steps = {name!r}, {accum}, {step_mode!r}, {steps}
cfg = build_config(model=name, run={run!r}, overrides=[
    "train.hardware=v6e-4", "train.allow_cpu_xla=true", "train.xla_step=cached",
    "train.lr=0.003"])
m = replace(cfg.model, vocab_size=32768)
if name == "1b":   # see the module docstring
    m = replace(m, n_embd=512, mlp_hidden=2048)
cfg = replace(cfg, model=replace(m, mlp_hidden=mlp_hidden(m)))
preset = get_preset("v6e-4")
backend = make_xla_backend(cfg, preset)
planned = make_plan(cfg, preset, backend.world_size, vocab=cfg.model.vocab_size)[1]
default_B, default_T, layout = planned.device_batch, planned.seq_len, planned.layout
B, T = 1, 64
model = backend.build_model(cfg.model, 0, layout)
raw = unwrap(model)
optimizer = make_optimizer(raw, cfg.train, "tpu", backend.autocast_dtype)
accumulate = backend.device_accumulation(model, accum) if step_mode != "traced" else None
update = backend.cached_update(raw, optimizer, 1.0) if step_mode == "cached" else None
rows = B * backend.devices_per_loader
gen = torch.Generator().manual_seed(0)
def batches():
    while True:
        t = torch.randint(0, m.vocab_size, (rows, T + 1), generator=gen)
        yield t[:, :-1].contiguous(), t[:, 1:].contiguous()
loader = batches()
def metric(key):
    d = met.metric_data(key)
    return d[1] / 1e6 if d else 0.0   # ms
backend.synchronize()
host, opt_ms = [], []
for step in range(2 + steps):
    xm.wait_device_ops()
    e0 = metric("ExecuteReplicatedTime")
    t0 = time.perf_counter()
    lr = set_lr(optimizer, 1e-3 * (1 + step / 10))
    if accumulate is not None:
        loss_sum = accumulate(loader)
    else:
        for micro in range(accum):
            x, y = backend.to_device(next(loader))
            with backend.autocast():
                loss = model(x, y)
            (loss / accum).backward()
    backend.all_reduce_grads(raw)
    t_opt = time.perf_counter()
    if update is not None:
        update(lr)
    else:
        clip_grad_norm(raw, 1.0)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t_opt = 1000 * (time.perf_counter() - t_opt)
    t_sync = time.perf_counter()
    backend.step_boundary()
    t1 = time.perf_counter()
    xm.wait_device_ops()
    t2 = time.perf_counter()
    executed = metric("ExecuteReplicatedTime") - e0
    sync_ms = 1000 * (t1 - t_sync)
    inline = 1000 * (t2 - t1) < 0.1 * executed   # the CPU ran the program inside the sync
    if step >= 2:
        opt_ms.append(t_opt)
        host.append(1000 * (t_sync - t0) + (max(0.0, sync_ms - executed) if inline else sync_ms))
print("BENCH " + json.dumps({{"host_ms": statistics.median(host), "host_all": host,
    "opt_ms": statistics.median(opt_ms),
    "compile_s": met.metric_data("CompileTime")[1] / 1e9,
    "compiles": met.metric_data("CompileTime")[0],
    "layout": layout.describe(), "default_batch": [default_B, default_T]}}))
"""


def run(name: str, accum: int, step_mode: str, steps: int) -> dict:
    # The async CPU client returns from the sync once the program is dispatched, as a TPU's
    # does, so the sync's host time is measured apart from the execution.
    env = dict(
        os.environ,
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES="4",
        PJRT_CPU_ASYNC_CLIENT="1",
        PYTHONPATH=str(ROOT),
    )
    code = CHILD.format(
        root=str(ROOT),
        run=os.path.join(tempfile.gettempdir(), "codex-bench-xla"),
        name=name,
        accum=accum,
        step_mode=step_mode,
        steps=steps,
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} accum {accum} {step_mode}: failed\n{proc.stderr[-3000:]}")
    line = next(s for s in proc.stdout.splitlines() if s.startswith("BENCH "))
    return json.loads(line[6:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,124m,1b")
    ap.add_argument("--accums", default="1,8")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after 2 warm-up steps")
    ap.add_argument("--modes", default="traced,fb-cached,cached", help="a subset, in this order")
    args = ap.parse_args()
    print(
        "v6e-4 mesh on 4 XLA CPU devices; 1 x 64 tokens per device per micro-batch; "
        "default optimizer (Muon)"
    )
    modes = tuple(args.modes.split(","))
    print(
        f"{'model':>5} {'accum':>5}  {'layout':>12}  "
        + "  ".join(f"{m + ' host ms':>17}" for m in modes)
        + "  "
        + "  ".join(f"{m + ' opt ms':>16}" for m in modes)
        + f"  {'cached / fb-cached':>18}  "
        + "  ".join(f"{m + ' compile s':>19}" for m in modes),
        flush=True,
    )
    for name in args.models.split(","):
        for accum in (int(a) for a in args.accums.split(",")):
            r = {mode: run(name, accum, mode, args.steps) for mode in modes}
            print(
                f"{name:>5} {accum:>5}  {r['cached']['layout']:>12}  "
                + "  ".join(f"{r[m]['host_ms']:>17.0f}" for m in modes)
                + "  "
                + "  ".join(f"{r[m]['opt_ms']:>16.1f}" for m in modes)
                + f"  {_ratio(r, 'cached', 'fb-cached'):>18}  "
                + "  ".join(f"{r[m]['compile_s']:>19.1f}" for m in modes),
                flush=True,
            )
            print("BENCH_JSON " + json.dumps({"model": name, "accum": accum, **r}), flush=True)


def _ratio(r: dict, a: str, b: str) -> str:
    return f"{r[a]['host_ms'] / r[b]['host_ms']:.2f}x" if a in r and b in r else "-"


if __name__ == "__main__":
    main()
