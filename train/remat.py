"""Rematerialisation (activation checkpointing), `train.remat`: none or block.

block: every transformer block keeps only its input for the backward pass and recomputes its
activations there, so a step holds one block's activations instead of n_layer blocks'. It is
applied from outside the model (`apply_remat`), so the model file, its parameter names, eval and
generation stay as they are. On XLA it is torch_xla's checkpoint, whose optimization barrier keeps
XLA from merging the recomputation back into the forward. Why, and what it saves: docs/hardware.md.
"""

from __future__ import annotations

import functools
from typing import cast

import torch


def checkpoint_fn(kind: str):
    """The checkpoint function for a backend's kind ("tpu" = XLA; "cpu", "cuda" = eager torch).
    The model has no dropout, so no RNG state needs restoring in the recomputation."""
    if kind == "tpu":
        from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint  # only on the XLA path

        return functools.partial(xla_checkpoint, use_reentrant=True, preserve_rng_state=False)
    from torch.utils.checkpoint import checkpoint

    return functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=False)


def apply_remat(model: torch.nn.Module, mode: str, kind: str) -> torch.nn.Module:
    """Wrap every block of `model` (a GPT) in a checkpoint when mode is "block"; "none" leaves it
    as it is. Called on the model the backend built (moved, compiled or FSDP-sharded): it replaces
    each block's forward, which FSDP2's module hooks and torch.compile's lazy first trace both go
    through. Returns the model."""
    if mode == "none":
        return model
    if mode != "block":
        raise ValueError(f"train.remat={mode!r}: expected none or block")
    checkpoint = checkpoint_fn(kind)
    for block in cast(torch.nn.ModuleList, model.blocks):
        block.forward = _checkpointed(block.forward, checkpoint)
    return model


def _checkpointed(forward, checkpoint):
    """forward (a block's bound method, so torch_xla's checkpoint finds the block's weights for
    its optimization barrier) run under `checkpoint` when a backward will follow; without
    gradients (validation) there is nothing to save memory for."""

    @functools.wraps(forward)
    def run(x, cos, sin, ve=None):
        if torch.is_grad_enabled():
            return checkpoint(forward, x, cos, sin, ve)
        return forward(x, cos, sin, ve)

    return run
