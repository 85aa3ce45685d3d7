"""Training tokens/s on a CPU beside a busy process: train.threads' default vs torch's default.

    python bench/bench_threads.py                 # tiny model, 40 steps per run, 3 rounds
    python bench/bench_threads.py --steps 10 --repeats 1

Each run is `codex train` in a fresh process (threads are fixed at process start) on the same
run directory (tinyshakespeare bytes as a byte-level vocab, bench/bench_train.py's make_run), with
checkpoints, validation and wandb off. tokens/s is read from metrics.jsonl over the steps after the
first log line (warm-up excluded; the loop syncs the device before it times a window).

Settings, each quiet and beside one busy process (a pure-Python loop, one core's worth of load):
  torch default   train.threads = the logical CPUs (what torch uses when nothing sets it)
  codex default   train.threads unset: train/plan/threads.py's physical cores / local processes
  1 thread        train.threads = 1
Rounds (--repeats) run every setting in turn; the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_train import make_run  # noqa: E402

CODEX = str(Path(sys.executable).parent / "codex")
BUSY = "while True: pass"


def tokens_per_s(run: Path, threads: int | None, steps: int, log_every: int) -> float:
    """One `codex train` process; tokens/s over the steps after the first metrics line."""
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    (run / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [CODEX, "train", "--run", str(run), "--model", "tiny", "--hardware", "cpu"]
    cmd += ["--max-steps", str(steps), "--wandb", "off", "--no-resume"]
    sets = {"log_every": log_every, "eval_every": 0, "save_every": 0, "warmup_steps": 2}
    if threads is not None:
        sets["threads"] = threads
    for k, v in sets.items():
        cmd += ["--set", f"train.{k}={v}"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"codex train failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in open(run / "metrics.jsonl") if '"train"' in x]
    first, timed = lines[0], lines[1:]
    if not timed:
        raise SystemExit(f"--steps {steps} gives one metrics line: raise it above --log-every")
    pairs = zip(lines[:-1], timed, strict=True)
    seconds = sum(r["step_time_s"] * (r["step"] - prev["step"]) for prev, r in pairs)
    return (timed[-1]["tokens"] - first["tokens"]) / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    logical = os.cpu_count() or 1
    settings = [("torch default", logical), ("codex default", None), ("1 thread", 1)]
    work = Path(tempfile.mkdtemp(prefix="bench_threads_"))
    results: dict[tuple[str, str], list[float]] = {}
    try:
        run = Path(make_run(work / "run", vocab=259, tokens=2_000_000))
        for _ in range(args.repeats):
            for load in ("quiet", "busy"):
                busy = subprocess.Popen([sys.executable, "-c", BUSY]) if load == "busy" else None
                try:
                    for name, threads in settings:
                        tps = tokens_per_s(run, threads, args.steps, args.log_every)
                        results.setdefault((load, name), []).append(tps)
                        print(f"{load:5} {name:14} {tps:9.0f} tok/s", flush=True)
                finally:
                    if busy:
                        busy.kill()
                        busy.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nmedian tokens/s over {args.repeats} round(s), {logical} logical CPUs here")
    print(f"{'setting':16} {'quiet':>9} {'beside busy':>12}")
    for name, _ in settings:
        q = statistics.median(results[("quiet", name)])
        b = statistics.median(results[("busy", name)])
        print(f"{name:16} {q:9.0f} {b:12.0f}")
    if args.json:
        rows = {f"{load}/{name}": v for (load, name), v in results.items()}
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
