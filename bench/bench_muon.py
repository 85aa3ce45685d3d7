"""Muon's Newton-Schulz: one matrix at a time against one stack per shape group, on a preset's
matrices (train/optim/muon.py).

    python bench/bench_muon.py                       # CPU, 124m's 84 matrices, fp32, 3 rounds
    python bench/bench_muon.py --model tiny --repeats 5
    python bench/bench_muon.py --device cuda         # bf16; the stacks also torch.compile'd

The matrices are the preset's block matrices (the model built on the meta device), each a random
momentum-blended gradient. Every variant starts from those fp32 matrices and iterates in the
dtype codex uses (fp32 on the CPU, bf16 on CUDA):

    per matrix    `orthogonalize` on each matrix in turn (the reference the stacks must equal)
    stacked       `newton_schulz` once per group of matrices sharing a wide shape, on a stack it
                  fills first (a tall matrix transposed), as Muon.step does
    stacked, 1/W  the stacks of the matrices rank 0 owns when W ranks share them
                  (`balanced_owners`): one rank's time under replicate or fsdp, gathering not
                  included
    compiled      (CUDA) stacked, through torch.compile as Muon runs it under train.compile

Each round times every variant once, in turn, after one warm-up call of each (CUDA: synchronised
before and after); the table shows the median of the rounds and each variant's largest
difference from the per-matrix updates.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from codex.core.config import build_config  # noqa: E402
from codex.model.gpt import GPT  # noqa: E402
from codex.train.optim.muon import (  # noqa: E402
    _compiled_newton_schulz,
    balanced_owners,
    is_hidden_matrix,
    newton_schulz,
    orthogonalize,
    wide,
)

STEPS = 5  # Muon's default ns_steps


def preset_shapes(model: str) -> list[tuple[int, int]]:
    cfg = build_config(model=model, overrides=["model.vocab_size=256"])
    with torch.device("meta"):
        gpt = GPT(cfg.model)
    return [tuple(p.shape) for n, p in gpt.named_parameters() if is_hidden_matrix(n, p)]


def per_matrix(mats: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [orthogonalize(m, STEPS, dtype) for m in mats]


def stacked(
    mats: list[torch.Tensor], dtype: torch.dtype, iterate: Callable = newton_schulz
) -> list[torch.Tensor]:
    """Every update, as Muon.step makes them: one stack per wide shape, iterated once."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(mats):
        groups.setdefault(wide(m.shape), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(mats)
    for shape, members in groups.items():
        stack = mats[0].new_empty((len(members), *shape), dtype=dtype)
        for j, i in enumerate(members):
            stack[j].copy_(mats[i].mT if mats[i].size(0) > mats[i].size(1) else mats[i])
        result = iterate(stack, STEPS)
        for j, i in enumerate(members):
            out[i] = result[j].mT if mats[i].size(0) > mats[i].size(1) else result[j]
    return out


def timed(fn: Callable[[], list[torch.Tensor]], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="124m")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", type=int, default=2, help="W of the 'stacked, 1/W' row")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shapes = preset_shapes(args.model)
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(s, generator=gen).to(args.device) for s in shapes]
    owner = balanced_owners([r * c for r, c in shapes], args.world)
    share = [m for m, q in zip(mats, owner, strict=True) if q == 0]
    variants: dict[str, Callable[[], list[torch.Tensor]]] = {
        "per matrix": lambda: per_matrix(mats, dtype),
        "stacked": lambda: stacked(mats, dtype),
        f"stacked, 1/{args.world}": lambda: stacked(share, dtype),
    }
    if args.device == "cuda":
        variants["compiled"] = lambda: stacked(mats, dtype, _compiled_newton_schulz())
    reference = per_matrix(mats, dtype)
    diffs = {}
    for name, fn in variants.items():  # warm-up (CUDA: the compiles), and the check
        got = fn()
        if len(got) == len(mats):
            diffs[name] = max(
                (a.float() - b.float()).abs().max().item()
                for a, b in zip(got, reference, strict=True)
            )
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn, args.device))
    groups = len({wide(s) for s in shapes})
    print(
        f"{args.model}: {len(shapes)} matrices in {groups} shape groups, {STEPS} steps, "
        f"{args.device} {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats}"
    )
    base = statistics.median(times["per matrix"])
    print(f"{'variant':<16} {'ms':>10} {'vs per matrix':>14} {'max |diff|':>12}")
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        diff = f"{diffs[name]:.1e}" if name in diffs else "-"
        print(f"{name:<16} {ms:>10.1f} {base * 1e3 / ms:>13.2f}x {diff:>12}")


if __name__ == "__main__":
    main()
