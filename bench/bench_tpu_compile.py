"""The plan against the TPU compiler: each TPU row compiled by `codex train --compile-only`
(train/compile_only.py), one process per row, and the plan's per-chip figure beside the
compiler's, with the layer loop's collectives, the modelled MFU and the compile time.

    .venv-xla/bin/python bench/bench_tpu_compile.py [--rows 124m:v6e-4,1b:v6e-8] [--out FILE]
        [--depths 2,4]

Each row is `codex hardware`'s for the model and slice (train/plan/report.py: model_fit: the
device batch, sequence length, layout and remat it offers), AdamW, bf16, the default vocabulary
(32768), accumulation 1.

The trace holds the model's real fp32 weights and optimizer state in this machine's memory. A
row whose state does not fit here is compiled at two smaller depths (--depths) of the same width,
batch and layout, and its per-chip HBM, FLOPs and bytes are extrapolated linearly in the depth to
the model's (fsdp scans the blocks as one layer loop, so each layer adds the same stacked
weights, state and saved activations). Those rows say "extrapolated"; their compile time is the
deeper trace's, not the model's. Minutes per row on 2 cores; run it alone.
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
ROWS = "124m:v6e-4,350m:v6e-4,1b:v6e-8,1b:v6e-16,7b:v6e-8,7b:v6e-16,7b:v6e-32,7b:v5p-8"

CHILD = """
import json, sys
from codex.core.config import build_config
from codex.train.compile_only import compile_only
cfg = build_config(overrides={overrides!r}, model={model!r}, run={run!r})
print("REPORT " + json.dumps(compile_only(cfg).to_dict()), flush=True)
"""


def offered(model: str, hardware: str) -> list[str]:
    """`codex hardware`'s row for the model on the slice, as settings (AdamW, bf16)."""
    from codex.train.plan.memory import Setting
    from codex.train.plan.presets import get_preset, preset_model
    from codex.train.plan.report import model_fit

    preset = get_preset(hardware)
    fit = model_fit(preset_model(model), preset, Setting(dtype="bf16", optimizer="adamw"))
    if not fit.batch:
        raise ValueError(f"codex hardware offers no batch for {model} on {hardware}")
    return [
        f"train.hardware={hardware}",
        "train.optimizer=adamw",
        f"train.parallel={fit.layout}",
        f"train.remat={fit.remat}",
        f"train.device_batch={fit.batch}",
        f"train.seq_len={fit.seq_len}",
        f"train.batch_tokens={fit.batch * fit.seq_len * preset.devices}",
    ]


def run_row(model: str, hardware: str, work: Path, extra: tuple[str, ...] = ()) -> dict:
    overrides = [*offered(model, hardware), *extra]
    script = CHILD.format(overrides=overrides, model=model, run=str(work / "run"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    if proc.returncode != 0 or not lines:
        error = [x for x in proc.stderr.splitlines() if "Error" in x]
        return {"model": model, "hardware": hardware, "error": (error or ["failed"])[-1]}
    report = json.loads(lines[0][len("REPORT ") :])
    return {"model": model, "hardware": hardware, "wall_s": wall, **report}


def extrapolated(model: str, hardware: str, work: Path, depths: list[int]) -> dict:
    """The row compiled at `depths` layers (same width, batch, layout), its step's per-chip
    figures extrapolated linearly to the model's depth; the plan is the full model's."""
    from codex.train.plan.memory import Setting, plan
    from codex.train.plan.presets import get_preset, preset_model

    m = preset_model(model)
    runs = [run_row(model, hardware, work, (f"model.n_layer={d}",)) for d in depths]
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    steps = [next(p for p in r["programs"] if p["name"] == "step") for r in runs]
    (d1, d2), (s1, s2) = depths, steps

    def at_depth(key: str) -> float:
        return s1[key] + (s2[key] - s1[key]) * (m.n_layer - d1) / (d2 - d1)

    record = dict(runs[-1])
    settings = dict(x.split("=", 1) for x in offered(model, hardware))
    B, T = int(settings["train.device_batch"]), int(settings["train.seq_len"])
    setting = Setting(
        dtype="bf16",
        optimizer="adamw",
        layout=settings["train.parallel"],
        remat=settings["train.remat"],
        accum=1,
    )
    record["planned_bytes"] = plan(m, get_preset(hardware), B, T, setting).total
    record["programs"] = [dict(s2, hbm_bytes=at_depth("hbm_bytes"))]
    record["extrapolated_from"] = depths
    record["modelled_mfu"] = None  # the time model needs the whole step's collectives
    return record


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
        f"{'-' if r['modelled_mfu'] is None else format(r['modelled_mfu'], '.1%')} | "
        f"{step['compile_s']:.0f} s "
        f"(trace + compile {r['wall_s']:.0f} s) |"
        + (
            f" extrapolated from {' and '.join(map(str, r['extrapolated_from']))} layers"
            if "extrapolated_from" in r
            else ""
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--out", default="", help="also write the records as JSON here")
    parser.add_argument("--depths", default="2,4", help="depths for a row too large here")
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
        if "this machine's memory" in record.get("error", ""):
            depths = [int(d) for d in args.depths.split(",")]
            record = extrapolated(model, hardware, work, depths)
        records.append(record)
        print(row_line(record), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
