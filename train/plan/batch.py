"""The batch arithmetic: train.batch_tokens = device_batch x seq_len x world x accum, the tokens
of one optimizer step. The one place gradient accumulation is decided: `grad_accum_steps` for the
run (train/plan/hardware.py: choose_batch, for `Plan` and `codex train --help` alike), refusing a
remainder; `micro_batches` for the memory plan's search of a default device batch, which plans
candidate batches before one is chosen. Imports nothing of train/, so every planner may use it.
"""

from __future__ import annotations

from codex.core.config import ConfigError


def micro_batches(batch_tokens: int, device_batch: int, seq_len: int, world: int) -> int:
    """Micro-batches per optimizer step at this device batch: batch_tokens / (device_batch x
    seq_len x world), 1 when batch_tokens is 0. A candidate batch that leaves a remainder counts
    the whole micro-batches (at least one): were the search to pick it, grad_accum_steps refuses
    it and names the device batches that divide."""
    return max(1, batch_tokens // max(1, device_batch * seq_len * world))


def grad_accum_steps(batch_tokens: int, device_batch: int, seq_len: int, world_size: int) -> int:
    """accum = batch_tokens / (device_batch * seq_len * world_size), or a ConfigError that lists
    the nearest valid batch_tokens and the device batch sizes that would divide."""
    per_micro = device_batch * seq_len * world_size
    accum = micro_batches(batch_tokens, device_batch, seq_len, world_size)
    if batch_tokens <= 0 or accum * per_micro == batch_tokens:
        return accum
    lo = (batch_tokens // per_micro) * per_micro
    nearest = sorted(
        (v for v in (lo, lo + per_micro) if v > 0), key=lambda v: (abs(v - batch_tokens), v)
    )
    msg = (
        f"train.batch_tokens={batch_tokens} is not a multiple of "
        "device_batch * seq_len * world_size = "
        f"{device_batch} * {seq_len} * {world_size} = {per_micro}. Nearest valid batch_tokens: "
        + " or ".join(f"{v} (accum {v // per_micro})" for v in nearest)
    )
    per_seq = seq_len * world_size
    if batch_tokens % per_seq == 0:
        seqs = batch_tokens // per_seq  # sequences per rank per step
        divisors = [b for b in range(1, seqs + 1) if seqs % b == 0]
        near = sorted(divisors, key=lambda b: (abs(b - device_batch), -b))[:4]
        msg += (
            f"; or keep it and use train.device_batch in {sorted(near)} "
            f"(accum = {seqs} / device_batch)"
        )
    else:
        msg += (
            "; no device batch fits: batch_tokens must be a multiple of "
            f"seq_len * world_size = {per_seq}"
        )
    raise ConfigError(msg)
