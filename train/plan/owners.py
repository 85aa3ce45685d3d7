"""Which rank orthogonalises which of Muon's matrices, and the shape it is iterated in: one rule
for Muon (train/optim/muon.py), which does the work, and for the memory plan (memory.py), which
counts it. Here, below both, so neither copies it."""

from __future__ import annotations

from collections.abc import Sequence


def wide(shape: Sequence[int]) -> tuple[int, int]:
    """The (rows, cols) a matrix of `shape` is iterated in: its own, or its transpose's when tall.
    Matrices with the same wide shape share a stack."""
    rows, cols = shape
    return (rows, cols) if rows <= cols else (cols, rows)


def balanced_owners(sizes: Sequence[int], world: int) -> list[int]:
    """The rank that orthogonalises each matrix (`sizes`: their entries): largest first, each to
    the rank with the fewest entries so far (the lowest such rank on a tie)."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner[i] = min(range(world), key=load.__getitem__)
        load[owner[i]] += sizes[i]
    return owner
