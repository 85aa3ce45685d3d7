"""Bytes alive during CPU training steps, counted while the step runs, in a layout (fsdp: FSDP2
over gloo; replicate) with gradient accumulation: what the memory plan's per-device terms
(train/plan/memory.py) are checked against by tests/train/plan/test_memory_plan.py. Prints one JSON
line
(rank 0's counts; the ranks hold the same amounts).

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        bench/count_step_memory.py LAYOUT OPTIMIZER ACCUM B T [model overrides ...]
    python bench/count_step_memory.py replicate OPTIMIZER ACCUM B T [...]   # one process

codex's own parts run as train/loop.py runs them (fp32, 1 thread): the model built in the layout
(fsdp: train/distributed/fsdp.py: build_sharded), make_optimizer (adamw, or muon: Muon + AdamW),
`set_grad_sync` on for the last micro-batch only (fsdp), the replicated gradient all-reduce
(train/distributed/backend.py: all_reduce_grads), clip_grad_norm, the optimizer step, zero_grad; two
optimizer steps, the second one measured (the first creates the optimizer state).

Counting: the bytes malloc has handed out and not taken back (glibc's mallinfo2: uordblks +
hblkhd, every arena, so every thread's frees count), read after every torch operation (a
TorchDispatchMode, forward and backward), by a thread every 0.1 ms (what lives only inside an
operation) and at the marks below. torch's CPU allocator is malloc,
so this is the bytes of every tensor alive (FSDP2's all-gather buffers and its unsharded gradients
included) plus a little of Python's and gloo's own; not the allocator's cache or the process's
RSS. (torch's profiler with profile_memory=True would count per allocation, but it misses a free
made on another thread, and gloo's threads free the buffers of the collectives DTensor runs.)
The first step also fills torch's
one-time caches (DTensor's sharding rules, lazily imported modules), so the counts are differences
inside the second step, on top of what is alive when it begins:

    state      the storage of every tensor the weights and the optimizer state hold (this rank's
               shards, the model's buffers), summed over the tensors themselves
    held       the most alive at the end of a micro-batch that does not reduce (ACCUM > 1), above
               the step's start: the gradients FSDP2 accumulates between micro-batches
    sharded    alive after the last micro-batch's backward (its reduce-scatter done), above the
               step's start: the gradients, and under replicate the reduction's buckets the
               backward filled (train/distributed/reduce.py)
    reduced    alive after all_reduce_grads, above the step's start: the reduced gradients the
               optimizer steps with (sharded - reduced: the reduction's buffers)
    backward   the most alive during the micro-batches' forwards and backwards, above the start
    step       the most alive during clip and optimizer.step(), above what was alive before
               them: the optimizer's own buffers (Muon's updates)
    peak       state + the most alive at any point of the step above its start
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from codex.core.config import build_config  # noqa: E402
from codex.model.gpt import build_model  # noqa: E402
from codex.train.distributed.backend import TorchBackend  # noqa: E402
from codex.train.distributed.fsdp import build_sharded  # noqa: E402
from codex.train.optim.optimizer import clip_grad_norm, make_optimizer  # noqa: E402
from codex.train.plan.layout import layout_for  # noqa: E402
from codex.train.plan.memory import Setting, plan  # noqa: E402
from codex.train.plan.presets import get_preset  # noqa: E402


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def in_use() -> int:
    """Bytes malloc has handed out and not taken back, over every arena (glibc >= 2.33)."""
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def settled() -> int:
    """in_use() once gloo's threads have let go of a collective's buffers: two reads 50 ms apart
    agree (a fixed wait is too short on a loaded machine), or after 2 s."""
    last = in_use()
    for _ in range(40):
        time.sleep(0.05)
        now = in_use()
        if now == last:
            return now
        last = now
    return last


class Meter(TorchDispatchMode):
    """The most bytes in use since `reset()`: read after every torch operation (forward and
    backward), and by a thread every 0.1 ms, which sees what lives only inside an operation (the
    flat buffer a collective fills on gloo's thread and copies out of)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.most = in_use()
        self.running = False
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while self.running:
            self.observe()
            time.sleep(1e-4)

    def observe(self) -> None:
        now = in_use()
        with self.lock:
            self.most = max(self.most, now)

    def reset(self) -> int:
        with self.lock:
            self.most = now = in_use()
        return now

    def __enter__(self):
        self.running = True
        self.thread.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.observe()
        return out


def tensor_bytes(model: torch.nn.Module, optimizer) -> int:
    """The bytes of every storage the model's parameters and buffers and the optimizer's state
    hold (this rank's shards of DTensors), each storage once."""
    from torch.distributed.tensor import DTensor

    tensors = [*model.parameters(), *model.buffers()]
    for opt in getattr(optimizer, "optimizers", {"": optimizer}).values():
        tensors += [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
    storages = {}
    for t in tensors:
        s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def main() -> None:
    """One run, top to bottom as the module docstring lists it: the counts are marks between
    consecutive statements of the step, so the step stays one readable block here."""
    layout_name, optimizer_name = sys.argv[1], sys.argv[2]
    accum, B, T = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    overrides = sys.argv[6:]
    torch.set_num_threads(1)
    launched = "WORLD_SIZE" in os.environ
    if launched:
        dist.init_process_group("gloo")
    world, rank = (dist.get_world_size(), dist.get_rank()) if launched else (1, 0)
    cfg = build_config(overrides=[*overrides, f"train.optimizer={optimizer_name}", "train.lr=1e-3"])
    m = cfg.model
    # fsdp: the gathered weights kept to the backward (ZeRO-2) or not, as the memory plan decides
    # for train (train/plan/plan.py: make_plan)
    setting = Setting(
        layout=layout_name, dtype="fp32", optimizer=optimizer_name, world=world, accum=accum
    )
    planned = plan(m, get_preset("cpu"), B, T, setting)
    layout = replace(
        layout_for(layout_name, 0, world), reshard_after_forward=planned.reshard_after_forward
    )
    backend = TorchBackend("cpu", torch.device("cpu"), rank, world, layout=layout)
    generator = torch.Generator().manual_seed(rank)
    batches = [
        (w[:, :-1].contiguous(), w[:, 1:].contiguous())
        for w in (torch.randint(0, m.vocab_size, (B, T + 1), generator=generator) for _ in range(8))
    ]
    gc.disable()
    meter = Meter()
    model = (
        build_sharded(m, 0, layout, torch.device("cpu"), None, False)
        if layout.sharded
        else build_model(m, 0)
    )
    optimizer = make_optimizer(model, cfg.train, "cpu", None)
    out: dict[str, int | str] = {"layout": layout.describe(), "world": world}
    with meter:
        for step in range(2):
            # Cyclic garbage (autograd graphs, collectives' work objects) goes when we say: a
            # collection in the middle of a step would move the counts from run to run.
            gc.collect()
            start = meter.reset()
            held = start
            for micro in range(accum):
                backend.set_grad_sync(model, micro == accum - 1)
                x, y = batches[(step * accum + micro) % len(batches)]
                (model(x, y) / accum).backward()
                if micro < accum - 1:
                    held = max(held, in_use())
            # gloo's threads release a collective's buffers when its work is done: wait for the
            # buckets the backward issued (replicate), then let gloo's threads finish
            reducer = getattr(backend, "_reducer", None)
            for bucket in reducer.buckets if reducer is not None else []:
                if bucket.work is not None:
                    bucket.work.wait()
            sharded = settled()
            backward = meter.most
            backend.all_reduce_grads(model)
            reduced = settled()
            before = meter.reset()
            clip_grad_norm(model, 1.0)
            optimizer.step()
            step_most = meter.most
            optimizer.zero_grad(set_to_none=True)
            state = tensor_bytes(model, optimizer)
            out.update(
                state=state,
                held=held - start,
                sharded=sharded - start,
                reduced=reduced - start,
                backward=backward - start,
                step=step_most - before,
                peak=state + max(backward, step_most) - start,
            )
    if rank == 0:
        print(json.dumps(out))
    if launched:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
