"""XLA training on the CPU backend: compile count, first-step and steady step time, and what
XLA_NO_SPECIAL_SCALARS=1 buys (a learning rate that changes every step must not recompile).

    PJRT_DEVICE=CPU .venv-xla/bin/python bench/bench_xla.py [--steps 20] [--devices 4]

Each configuration runs in its own process (one XLA runtime per process). Numbers on the XLA CPU
backend say nothing about TPU speed; they show the compile behaviour, which is the same.
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

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from pathlib import Path
from codex.config import build_config
from tests.train_helpers import make_run
from train.loop import train
import torch_xla.debug.metrics as met
run = {run!r}
make_run(Path(run))
ov = ["train.hardware={hw}", "train.device_batch=2", "train.seq_len=32", "train.batch_tokens=512",
      "train.max_steps={steps}", "train.warmup_steps=2", "train.log_every={steps}", "train.eval_every=0",
      "train.save_every=0", "train.wandb=off", "train.dtype=fp32", "train.allow_cpu_xla=true"]
t0 = time.perf_counter()
r = train(build_config(overrides=ov, model="tiny", run=run))
total = time.perf_counter() - t0
m = [json.loads(l) for l in open(Path(run) / "metrics.jsonl")]
compile_s = met.metric_data("CompileTime")[1] / 1e9
print("BENCH " + json.dumps({{"compiles": met.metric_data("CompileTime")[0], "compile_s": compile_s,
                             "total_s": total, "step_ms_logged": 1000 * m[-1]["step_time_s"]}}))
"""


def run(devices: int, steps: int, special_scalars_off: bool) -> dict:
    hw = {1: "v6e-1", 4: "v6e-4", 8: "v6e-8"}[devices]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT))
        env["XLA_NO_SPECIAL_SCALARS"] = "1" if special_scalars_off else "0"
        code = CHILD.format(root=str(ROOT), run=os.path.join(tmp, "run"), hw=hw, steps=steps)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        line = next(l for l in proc.stdout.splitlines() if l.startswith("BENCH "))
        return json.loads(line[6:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--devices", type=int, default=4, choices=[1, 4, 8])
    args = ap.parse_args()
    print(f"tiny model, seq 32, 512 tokens/step (accum 2), {args.devices} XLA CPU devices, SPMD, {args.steps} steps")
    print(f"{'XLA_NO_SPECIAL_SCALARS':>22}  {'compiles':>8}  {'compile s':>9}  {'total s':>7}  {'ms/step (last window)':>21}")
    for flag in (True, False):
        r = run(args.devices, args.steps, flag)
        print(f"{int(flag):>22}  {r['compiles']:>8}  {r['compile_s']:>9.1f}  {r['total_s']:>7.1f}  "
              f"{r['step_ms_logged']:>21.0f}")


if __name__ == "__main__":
    main()
