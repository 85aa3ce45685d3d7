"""Peak memory of one CPU training step, printed in bytes: what the memory plan
(train/plan/memory.py) is checked against by bench/bench_memory.py and
tests/train/plan/test_memory_plan.py.

    python bench/measure_step_memory.py [--compile] DTYPE B T [model overrides ...]  # fresh process

Forward (under bf16 autocast for DTYPE bf16), backward and one AdamW step of model/gpt.py with 1
thread.

Eager (the default): peak = this process's resident high-water mark (VmHWM in /proc/self/status)
after the step minus the resident size (/proc/self/statm) before the model is built (torch
imported, nothing allocated). Not the high-water mark there: the imports' transient peak varies
with the environment. Not ru_maxrss: Linux carries it across execve, so a child of a big process (a
long pytest run) starts with its parent's peak.

--compile: the model under torch.compile (inductor), as the CUDA backend runs it. The first step
compiles (its peak is the compiler's, not the step's) and allocates AdamW's moments; the second
step is measured: the high-water mark is reset (/proc/self/clear_refs) after the gradients are
freed (zero_grad, as the training loop does), and peak = the bytes of the weights and the optimizer
state + how far the second step's resident size rises above the size it starts at (which also holds
the compiled code, not the plan's).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import resource
import sys
from pathlib import Path

# the compile's worker processes are other processes: one, to leave the machine's cores alone
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from codex.core.config import build_config  # noqa: E402
from codex.model.gpt import build_model  # noqa: E402

ap = argparse.ArgumentParser(description="peak bytes of one CPU training step")
ap.add_argument("--compile", action="store_true", help="torch.compile; measure the second step")
ap.add_argument("dtype", choices=["fp32", "bf16"])
ap.add_argument("B", type=int)
ap.add_argument("T", type=int)
ap.add_argument("overrides", nargs="*")
args = ap.parse_args()
torch.set_num_threads(1)
m = build_config(overrides=args.overrides).model


def high_water() -> int:
    """VmHWM: the peak resident bytes of this process's own memory (new at execve)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def resident() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()


def autocast():
    if args.dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def eager() -> int:
    import_peak = high_water()
    base = resident()
    model = build_model(m, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, m.vocab_size, (args.B, args.T))
    with autocast():
        loss = model(x, x)
    loss.backward()
    opt.step()
    peak = high_water()
    assert peak > import_peak, "the step's peak is below the imports' own: not measured"
    return peak - base


def compiled() -> int:
    # Every block of 64 KiB or more its own mapping, returned to the system when freed: glibc would
    # otherwise raise this threshold as the first step frees large blocks and keep what the
    # second step reuses in its heap, where the resident size never shows it again.
    M_MMAP_THRESHOLD = -3
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 << 10)
    model = build_model(m, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    step_fn = torch.compile(model)
    x = torch.randint(0, m.vocab_size, (args.B, args.T))

    def step() -> None:
        with autocast():
            loss = step_fn(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # compiles, and makes AdamW's moments
    gc.collect()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    start = resident()
    with open("/proc/self/clear_refs", "w") as f:  # the high-water mark := the resident size
        f.write("5")
    step()
    rise = high_water() - start
    assert rise > 0, "the second step raised no resident memory: not measured"
    return held + rise


print(compiled() if args.compile else eager())
