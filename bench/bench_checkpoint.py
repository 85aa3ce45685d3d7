"""Checkpoint save time on the CPU for the 350m preset's training state (fp32 weights + AdamW's two
moments, ~4 GB): one writer vs DCP with every rank writing its own shards.

    PYTHONPATH=. python bench/bench_checkpoint.py                  # local disk, under /tmp
    PYTHONPATH=. python bench/bench_checkpoint.py --dir DISK --vocab 32768   # under DISK

Rows:
  torch.save, 1 process     the single-file format codex used before DCP (rank 0 wrote everything):
                            torch.save of the whole state + fsync
  DCP, 1 process            train/checkpoint/folders.py: save in one process (what replicate on
                            one GPU does)
  DCP, 2 ranks (fsdp)       the same save on 2 gloo ranks under torchrun, each holding and
                            writing half of every tensor (FSDP2 DTensors); the time of the slower
                            rank
  async, 1st: loop blocked  the first save with train.async_save (save_in_background): the time
                            the caller waits, which includes making the staging buffer (its
                            pages are touched for the first time) and starting the writer process
  async: loop blocked       the steady state: the 2nd and 3rd async saves (the buffer is reused,
                            the writer runs), the slower save of the slower rank: the time the
                            caller waits (the copy of the rank's shards into the buffer)
  async: until DONE         the same saves until DONE exists (nothing trains meanwhile here, so
                            this is the writer processes' own time)
Every row includes writing DONE (and state.json, sha256 of every file) where it applies. Nothing
here compresses, so constant values write the bytes a real checkpoint writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from codex.core.config import build_config

GB = 1e9


def model_config(vocab: int):
    m = build_config(model="350m").model
    m.vocab_size = vocab
    return m


def adam_state(named_params) -> dict:
    return {
        n: {
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
            "step": torch.tensor(1.0),
        }
        for n, p in named_params
    }


def training_state(model) -> dict:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)  # touch the memory: untouched pages would make copies look free
        return {
            "model": model.state_dict(),
            "optimizer": {"adamw": {"state": adam_state(model.named_parameters())}},
            "step": 1,
            "tokens": 0,
        }


def one_process(vocab: int, folder: str) -> list[tuple[str, float, float]]:
    from codex.model.gpt import GPT
    from codex.train.checkpoint import folders as checkpoint

    with torch.device("meta"):
        model = GPT(model_config(vocab))
    model.to_empty(device="cpu")
    state = training_state(model)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    rows = []
    path = os.path.join(folder, "ckpt.pt")
    t = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    rows.append(("torch.save, 1 process", nbytes / GB, time.perf_counter() - t))
    os.unlink(path)
    t = time.perf_counter()
    checkpoint.save(os.path.join(folder, "dcp1"), state)
    rows.append(("DCP, 1 process", nbytes / GB, time.perf_counter() - t))
    shutil.rmtree(os.path.join(folder, "dcp1"))
    return rows


def _tensors(tree):
    for v in tree.values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            yield from _tensors(v)


def worker(vocab: int, folder: str, out: str) -> None:
    """One of 2 torchrun ranks: an FSDP2-sharded 350m state, then one timed checkpoint.save."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from codex.model.gpt import GPT
    from codex.train.checkpoint import async_save
    from codex.train.checkpoint import folders as checkpoint
    from codex.train.distributed.control import ControlPlane
    from codex.train.distributed.fsdp import make_mesh
    from codex.train.plan.layout import Layout

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    control = ControlPlane(dist.new_group(backend="gloo"), rank, world)
    with torch.device("meta"):
        model = GPT(model_config(vocab))
    mesh = make_mesh(Layout("fsdp", shard=world), "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    state = training_state(model)
    local = sum(
        t.to_local().numel() * 4 if hasattr(t, "to_local") else t.numel() * t.element_size()
        for t in _tensors(state)
    )
    control.barrier()
    t = time.perf_counter()
    checkpoint.save(os.path.join(folder, "dcp2"), state, control=control)
    seconds = time.perf_counter() - t
    # train.async_save: the loop is blocked only while the state is copied; then the writer
    # process writes it. The first save makes the buffer and starts the writer; later ones reuse
    # both (the steady state a training run is in).
    writer = async_save.BackgroundWriter(control)
    blocked, total = [], []
    for step in (2, 3, 4):
        control.barrier()
        state["step"] = step
        t = time.perf_counter()
        pending = async_save.save_in_background(
            os.path.join(folder, "dcp2"), state, writer, keep_last=1
        )
        blocked.append(time.perf_counter() - t)
        pending.wait()
        total.append(time.perf_counter() - t)
    writer.close()
    times = control.gather((seconds, local, blocked, total))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "seconds": max(r[0] for r in times),
                    "bytes": sum(r[1] for r in times),
                    "first_blocked": max(r[2][0] for r in times),
                    "blocked": max(max(r[2][1:]) for r in times),
                    "async_total": max(max(r[3][1:]) for r in times),
                },
                f,
            )
    control.barrier()
    dist.destroy_process_group()


def two_ranks(vocab: int, folder: str) -> list[tuple[str, float, float]]:
    out = os.path.join(folder, "two.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        __file__,
        "--worker",
        "--vocab",
        str(vocab),
        "--dir",
        folder,
        "--out",
        out,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env)
    r = json.load(open(out))
    shutil.rmtree(os.path.join(folder, "dcp2"))
    gb = r["bytes"] / GB
    return [
        ("DCP, 2 ranks (fsdp)", gb, r["seconds"]),
        ("  async, 1st: loop blocked", gb, r["first_blocked"]),
        ("  async: loop blocked", gb, r["blocked"]),
        ("  async: until DONE", gb, r["async_total"]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument(
        "--dir", default=None, help="where to write (default: a temporary folder in /tmp)"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.vocab, args.dir, args.out)
        return
    folder = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    try:
        rows = one_process(args.vocab, folder) + two_ranks(args.vocab, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{'writer':<27} {'GB':>6} {'seconds':>8} {'GB/s':>6}")
    for name, gb, s in rows:
        print(f"{name:<27} {gb:6.2f} {s:8.2f} {gb / s:6.2f}")
    seconds = dict((name, s) for name, _, s in rows)
    print(
        "async: loop blocked / DCP, 2 ranks: "
        f"{seconds['  async: loop blocked'] / seconds['DCP, 2 ranks (fsdp)']:.1%} (steady state), "
        f"{seconds['  async, 1st: loop blocked'] / seconds['DCP, 2 ranks (fsdp)']:.1%} (1st save)"
    )


if __name__ == "__main__":
    main()
