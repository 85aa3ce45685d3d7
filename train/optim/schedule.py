"""The learning-rate schedule as a pure function of the step (warmup, then cosine or
warmup-stable-decay), and setting it on the optimizer's groups each step.
"""

from __future__ import annotations

import math


def lr_at(
    step: int,
    *,
    max_lr: float,
    total_steps: int,
    warmup_steps: int,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate for optimizer step `step` (0-based).

    warmup: linear from max_lr/warmup to max_lr over the first warmup_steps steps; then
    cosine: half a cosine from max_lr down to min_lr_ratio*max_lr at the last step, or
    wsd (warmup-stable-decay): max_lr until the last decay_fraction of the steps, then linear down
    to min_lr_ratio*max_lr.

    7 parameters: keyword-only schedule settings, so the pure function is tested without a config;
    lr_for passes train.*."""
    min_lr = max_lr * min_lr_ratio
    if warmup_steps > 0 and step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if schedule == "cosine":
        span = max(1, total_steps - 1 - warmup_steps)
        progress = min(1.0, max(0.0, (step - warmup_steps) / span))
        return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    # wsd (config.check_values allows only these two)
    decay_steps = max(1, int(round(decay_fraction * total_steps)))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return max_lr
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return max_lr + (min_lr - max_lr) * progress


def lr_for(step: int, tcfg, total_steps: int) -> float:
    """lr_at with the train.* settings."""
    return lr_at(
        step,
        max_lr=tcfg.lr,
        total_steps=total_steps,
        warmup_steps=tcfg.warmup_steps,
        schedule=tcfg.schedule,
        min_lr_ratio=tcfg.min_lr_ratio,
        decay_fraction=tcfg.decay_fraction,
    )


def set_lr(optimizer, lr: float) -> float:
    """Set the schedule's lr (train.lr's scale) on every group; a group with an lr_ratio (Muon's)
    gets lr * lr_ratio. Returns lr."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_ratio"] if "lr_ratio" in group else lr
    return lr
