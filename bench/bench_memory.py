"""The memory plan (train/plan/memory.py) against the measured peak of one CPU training step, and
the preset tables it produces.

    PYTHONPATH=. python bench/bench_memory.py           # CPU: estimate vs measured peak (~5 min)
    PYTHONPATH=. python bench/bench_memory.py --tables  # `codex hardware` and
                                                        # `codex hardware --model 1b`

Each setting runs in a fresh process: forward (under bf16 autocast for the bf16 rows), backward and
one AdamW step of model/gpt.py with 1 thread (bench/measure_step_memory.py). Eager rows: peak = the
process's resident high-water mark (VmHWM) after the step minus the resident size
(/proc/self/statm) before the model is built (torch imported, nothing allocated). Compiled rows
(torch.compile, inductor, as the CUDA backend runs the step): the second step's, the weights and
AdamW's state plus how far the step raises the resident size; the plan counts them compiled.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from codex.core.config import build_config
from codex.train.plan.memory import Setting, plan
from codex.train.plan.presets import get_preset
from codex.train.plan.report import format_hardware_table, format_model_fit

# prints the peak in bytes
MEASURE = str(Path(__file__).resolve().parent / "measure_step_memory.py")

# (dtype, device batch, seq_len, model overrides on the default 4 x 128 model)
SETTINGS = [
    ("fp32", 8, 1024, ["model.vocab_size=256", "model.max_seq_len=1024"]),
    ("fp32", 32, 256, ["model.vocab_size=8192"]),
    ("fp32", 32, 256, ["model.vocab_size=8192", "model.qk_norm=false", "model.mlp=relu2"]),
    ("fp32", 16, 256, ["model.vocab_size=4096", "model.n_kv_head=2", "model.n_layer=2"]),
    (
        "fp32",
        4,
        512,
        ["model.vocab_size=512", "model.n_embd=256", "model.n_kv_head=2", "model.max_seq_len=512"],
    ),
    ("bf16", 8, 1024, ["model.vocab_size=256", "model.max_seq_len=1024"]),
    ("bf16", 32, 256, ["model.vocab_size=8192"]),
    ("bf16", 16, 256, ["model.vocab_size=4096", "model.n_kv_head=2", "model.n_layer=2"]),
]
# compiled: the default model, 6 x 384 (22M parameters) and 8 x 640 (58M)
WIDER = ["model.n_layer=6", "model.n_embd=384", "model.n_head=6", "model.n_kv_head=2"]
WIDEST = ["model.n_layer=8", "model.n_embd=640", "model.n_head=10", "model.n_kv_head=5"]
COMPILED = [
    ("fp32", 8, 256, ["model.vocab_size=4096"]),
    ("bf16", 8, 256, ["model.vocab_size=4096"]),
    ("fp32", 8, 256, ["model.vocab_size=32768"]),
    ("fp32", 8, 128, ["model.vocab_size=4096", "model.mlp=relu2", "model.qk_norm=false"]),
    ("fp32", 4, 512, [*WIDER, "model.vocab_size=16384", "model.max_seq_len=512"]),
    ("bf16", 16, 512, [*WIDER, "model.vocab_size=16384", "model.max_seq_len=512"]),
    ("fp32", 4, 256, [*WIDEST, "model.vocab_size=16384", "model.max_seq_len=256"]),
    ("bf16", 8, 512, [*WIDEST, "model.vocab_size=16384", "model.max_seq_len=512"]),
]


def measured_peak(dtype: str, B: int, T: int, overrides: list[str], compiled: bool = False) -> int:
    out = subprocess.run(
        [sys.executable, MEASURE, *(["--compile"] if compiled else []), dtype, str(B), str(T)]
        + overrides,
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return int(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tables", action="store_true", help="print the preset tables instead")
    args = ap.parse_args()
    if args.tables:
        print(format_hardware_table())
        print()
        print(format_model_fit("1b"))
        return
    print(
        "| step | dtype | B x T | model (default 4 x 128 plus) | measured peak MB | plan MB "
        "| plan / measured |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = [(False, *row) for row in SETTINGS] + [(True, *row) for row in COMPILED]
    for compiled, dtype, B, T, overrides in rows:
        peak = measured_peak(dtype, B, T, overrides, compiled)
        setting = Setting(dtype=dtype, compiled=compiled)
        est = plan(build_config(overrides=overrides).model, get_preset("cpu"), B, T, setting).total
        shape = ", ".join(o.removeprefix("model.") for o in overrides)
        print(
            f"| {'compiled' if compiled else 'eager'} | {dtype} | {B} x {T} | {shape} "
            f"| {peak / 1e6:.0f} | {est / 1e6:.0f} | {est / peak:.2f} |"
        )


if __name__ == "__main__":
    main()
