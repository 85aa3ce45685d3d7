"""Every step's time over a run with warmup and the managed GC inside it: no step outside
validation and saves may take more than twice the median.

    python bench/bench_step_times.py                                # CPU: a small model
    python bench/bench_step_times.py --hardware h100 --model 124m --batch 64 --seq 1024  # a GPU

codex train (train/loop.py) runs 120 steps with log_every=1 and its defaults otherwise
(warmup_steps=50, gc_every=50: step 50 ends the warmup and runs a GC collection), validation and
periodic saves off (the last step still saves). Each metrics line's step_time_s is its own step's
time after a device sync. --compile-on-cpu runs the CUDA path's torch.compile on the CPU
(inductor), where the start-up leaves the most objects for the collector. Prints every step's time,
the median, the slowest steady step and their ratio, and exits 1 when the ratio is over 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_train import make_run  # noqa: E402
from codex.core.config import build_config  # noqa: E402
from codex.eval.evaluate import evaluate  # noqa: E402
from codex.train.loop import train  # noqa: E402

SMALL = ["model.n_layer=4", "model.n_head=4", "model.n_kv_head=4", "model.n_embd=128"]


def step_times(args: argparse.Namespace, run: str) -> list[tuple[int, float]]:
    """(step, seconds) for every step of one codex train run."""
    overrides = [
        f"train.hardware={args.hardware}",
        f"train.device_batch={args.batch}",
        f"train.seq_len={args.seq}",
        f"train.max_steps={args.steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.save_every=0",
        "train.wandb=off",
        *([] if args.model else [*SMALL, f"model.max_seq_len={args.seq}"]),
    ]
    train(build_config(overrides=overrides, model=args.model, run=run), evaluate)
    lines = [json.loads(line) for line in open(Path(run) / "metrics.jsonl")]
    return [(r["step"], r["step_time_s"]) for r in lines if r.get("kind") == "train"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--model", default=None, help="a model preset; default a 4 x 128 model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--compile-on-cpu", action="store_true")
    args = ap.parse_args()
    if args.compile_on_cpu:
        import codex.train.launch as launch

        make_backend = launch.make_backend

        def compiled(cfg, **kwargs):
            backend = make_backend(cfg, **kwargs)
            backend.compile = True
            return backend

        launch.make_backend = compiled
    with tempfile.TemporaryDirectory() as tmp:
        tokens = args.batch * args.seq * (args.steps + 10)
        run = make_run(Path(tmp) / "run", args.vocab, max(tokens, 200_000))
        times = step_times(args, run)
    for step, s in times:
        print(f"step {step:4d}  {1000 * s:8.1f} ms")
    # start-up: the first step (allocations, torch.compile) and the second (whose time holds the
    # collection that ends start-up, train/loop.py: ManagedGC.start_up_done); the last step saves
    steady = [(step, s) for step, s in times if 2 < step < args.steps]
    median = statistics.median(s for _, s in steady)
    step, slowest = max(steady, key=lambda t: t[1])
    ratio = slowest / median
    print(
        f"\nmedian {1000 * median:.1f} ms | slowest step {step}: {1000 * slowest:.1f} ms | "
        f"{ratio:.2f}x the median (target <= 2x)"
    )
    sys.exit(0 if ratio <= 2 else 1)


if __name__ == "__main__":
    main()
