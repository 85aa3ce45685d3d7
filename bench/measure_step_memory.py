"""Peak memory of one CPU training step, printed in bytes: what the memory plan
(train/plan/memory.py) is checked against by bench/bench_memory.py and tests/test_memory_plan.py.

    python bench/measure_step_memory.py DTYPE B T [model overrides ...]    # run in a fresh process

Forward (under bf16 autocast for DTYPE bf16), backward and one AdamW step of model/gpt.py with 1
thread; peak = this process's resident high-water mark (VmHWM in /proc/self/status) after the step
minus the resident size (/proc/self/statm) before the model is built (torch imported, nothing
allocated). Not the high-water mark there: the imports' transient peak varies with the
environment. Not ru_maxrss: Linux carries it across execve, so a child of a big process (a long
pytest run) starts with its parent's peak.
"""

import contextlib
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from codex.core.config import build_config  # noqa: E402
from codex.model.gpt import build_model  # noqa: E402

torch.set_num_threads(1)
dtype, B, T, overrides = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
m = build_config(overrides=overrides).model


def high_water() -> int:
    """VmHWM: the peak resident bytes of this process's own memory (new at execve)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


import_peak = high_water()
base = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()  # resident now
model = build_model(m, seed=0)
opt = torch.optim.AdamW(model.parameters())
x = torch.randint(0, m.vocab_size, (B, T))
with torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext():
    loss = model(x, x)
loss.backward()
opt.step()
peak = high_water()
assert peak > import_peak, "the step's peak is below the imports' own: not measured"
print(peak - base)
