"""The plan against the TPU compiler: each TPU row compiled by `codex train --compile-only`
(train/compile_only.py), one process per row, and the plan's per-chip figure beside the
compiler's, with the layer loop's collectives, the modelled MFU and the compile time.

    .venv-xla/bin/python bench/bench_tpu_compile.py [--rows 124m:v6e-4,1b:v6e-8] [--out FILE]

Each row is `codex hardware`'s default for the model and slice (device batch, sequence length,
layout, remat) at the default vocabulary (32768). The trace holds the model's real fp32 weights
and optimizer state in this machine's memory, so a row too large for it is listed as not traced,
with the memory it needs. Minutes per row on 2 cores; run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The rows issue 53 asks for, smallest first.
ROWS = "124m:v6e-4,1b:v6e-8,1b:v6e-16,7b:v6e-8,7b:v6e-16,7b:v6e-32,7b:v5p-8"

CHILD = """
import json, sys
from codex.core.config import build_config
from codex.train.compile_only import compile_only
cfg = build_config(overrides={overrides!r}, model={model!r}, run={run!r})
print("REPORT " + json.dumps(compile_only(cfg).to_dict()), flush=True)
"""


def run_row(model: str, hardware: str, work: Path) -> dict:
    overrides = [f"train.hardware={hardware}", "train.optimizer=adamw"]
    script = CHILD.format(overrides=overrides, model=model, run=str(work / "run"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    if proc.returncode != 0 or not lines:
        error = [x for x in proc.stderr.splitlines() if "Error" in x or "error" in x]
        return {"model": model, "hardware": hardware, "error": (error or ["failed"])[-1]}
    report = json.loads(lines[0][len("REPORT ") :])
    return {"model": model, "hardware": hardware, "wall_s": wall, **report}


def row_line(r: dict) -> str:
    if "error" in r:
        return f"| {r['model']} | {r['hardware']} | not compiled: {r['error'][:160]} |"
    step = next(p for p in r["programs"] if p["name"] == "step")
    loop = [c for c in step["collectives"] if c["place"] == "layer loop"]
    kinds = sorted({c["kind"] + (" async" if c["is_async"] else "") for c in loop})
    return (
        f"| {r['model']} | {r['hardware']} ({r['topology']}) | {r['layout']} | "
        f"{r['device_batch']} x {r['seq_len']} x accum {r['accum']} | "
        f"{r['planned_bytes'] / 1e9:.2f} | {step['hbm_bytes'] / 1e9:.2f} | "
        f"{step['hbm_bytes'] / r['planned_bytes']:.2f} | {', '.join(kinds) or '-'} | "
        f"{r['modelled_mfu']:.1%} | {step['compile_s']:.0f} s "
        f"(trace + compile {r['wall_s']:.0f} s) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--out", default="", help="also write the records as JSON here")
    args = parser.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "codex-bench-tpu-compile"
    work.mkdir(parents=True, exist_ok=True)
    print(
        "| model | slice | layout | batch per chip | planned GB | compiled GB | compiled / "
        "planned | layer loop collectives | modelled MFU | TPU compile |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    records = []
    for row in args.rows.split(","):
        model, hardware = row.split(":")
        record = run_row(model, hardware, work)
        records.append(record)
        print(row_line(record), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
