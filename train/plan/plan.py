"""The run's plan: what training derives once from the config, the hardware preset and the run's
files (tokenizer, shard manifest), before the first step.

    cfg, plan, token_bytes = make_plan(cfg, preset, world_size)

Batch: train.batch_tokens tokens per optimizer step = device_batch * seq_len * world * accum
(grad_accum_steps says which values divide); the device batch and sequence length default to the
memory plan's (train/plan/memory.py), and a setting the plan says cannot fit is refused (exit 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from codex.core import fsio, rundir
from codex.core.config import ConfigError
from codex.core.config.train import DEFAULT_LR
from codex.model.gpt import mlp_hidden
from codex.pipeline.tokenizer.tokenizer import TOKEN_BYTES_FILE, load_meta, load_token_bytes
from codex.train.data.token_shards import load_manifest
from codex.train.plan.hardware import device_defaults
from codex.train.plan.layout import Layout, layout_for
from codex.train.plan.memory import MemoryPlan, check_fits, choose_layout, fsdp_refusal, setting_for

# --- batch arithmetic -------------------------------------------------------------------------


def grad_accum_steps(batch_tokens: int, device_batch: int, seq_len: int, world_size: int) -> int:
    """accum = batch_tokens / (device_batch * seq_len * world_size), or a ConfigError that lists
    the nearest valid batch_tokens and the device batch sizes that would divide."""
    per_micro = device_batch * seq_len * world_size
    if batch_tokens <= 0:
        return 1
    if batch_tokens % per_micro == 0:
        return batch_tokens // per_micro
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


def resolve_batch(cfg, preset, world_size: int) -> tuple[int, int, int, int, MemoryPlan, Layout]:
    """(device_batch, seq_len, accum, batch_tokens, memory plan, layout) from codex.train.* and the
    hardware preset defaults (the memory plan's); a setting whose memory plan cannot fit is refused
    (exit 2)."""
    B, T = cfg.train.device_batch, cfg.train.seq_len
    setting = setting_for(cfg.train, preset.kind, world_size)
    refusal = fsdp_refusal(preset)
    if setting["layout"] == "fsdp" and refusal and world_size > 1:
        raise ConfigError(f"{refusal}: use train.parallel=replicate (or auto)")
    if B <= 0 or T <= 0:
        dB, dT = device_defaults(preset, cfg.model, **setting)
        B = B if B > 0 else dB
        T = T if T > 0 else dT
    if T > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={T} is longer than model.max_seq_len={cfg.model.max_seq_len}; "
            f"lower --seq-len or --set model.max_seq_len={T}"
        )
    if setting["layout"] == "auto":  # train.parallel=auto: the memory plan picks
        setting["layout"] = choose_layout(cfg.model, preset, B, T, **setting)
    # over this run's world size, with its accumulation (fsdp holds whole gradients then)
    memory = check_fits(cfg.model, preset, B, T, **setting)
    layout = layout_for(setting["layout"], setting["fsdp_size"], world_size)
    # fsdp: keep the gathered weights from forward to backward (ZeRO-2) where the plan fits them
    layout = replace(layout, reshard_after_forward=memory.reshard_after_forward)
    accum = grad_accum_steps(cfg.train.batch_tokens, B, T, world_size)
    return B, T, accum, B * T * world_size * accum, memory, layout


# --- the plan: what the loop derives from the config and the run's files, once -----------------


@dataclass(frozen=True)
class Plan:
    vocab: int
    device_batch: int  # B: sequences per device per micro-batch
    seq_len: int  # T
    accum: int  # micro-batches per optimizer step
    batch_tokens: int  # tokens per optimizer step = B * T * world_size * accum
    total_steps: int
    world_size: int
    tokenizer_sha: str  # recorded in checkpoints: eval and sample refuse a retrained tokenizer
    memory: MemoryPlan  # bytes per device (train/plan/memory.py), logged at start
    layout: Layout  # replicate or fsdp (train.parallel, resolved; train/plan/layout.py)


def make_plan(cfg, preset, world_size: int):
    """(the resolved config, the Plan, token_bytes). The resolved config carries the tokenizer's
    vocab size, the MLP width (so a later change of the derivation cannot change a saved model's
    shape) and the learning rate (train.lr 0 = the optimizer's default): it is what checkpoints
    record and what eval rebuilds the model from."""
    vocab, token_bytes, tokenizer_sha = _read_vocab(cfg)
    cfg = replace(
        cfg,
        model=replace(cfg.model, vocab_size=vocab, mlp_hidden=mlp_hidden(cfg.model)),
        train=replace(cfg.train, lr=cfg.train.lr or DEFAULT_LR[cfg.train.optimizer]),
    )
    B, T, accum, batch_tokens, memory, layout = resolve_batch(cfg, preset, world_size)
    total_steps = (
        math.ceil(cfg.train.max_tokens / batch_tokens)
        if cfg.train.max_tokens > 0
        else cfg.train.max_steps
    )
    if total_steps <= 0:
        raise ConfigError("train.max_steps (or train.max_tokens) must be positive")
    plan = Plan(
        vocab, B, T, accum, batch_tokens, total_steps, world_size, tokenizer_sha, memory, layout
    )
    return cfg, plan, token_bytes


# --- run inputs -------------------------------------------------------------------------------


def _read_vocab(cfg) -> tuple[int, torch.Tensor | None, str]:
    """Vocab size from the run's tokenizer meta (checked against the shard manifest), token_bytes
    for bits per byte (None when absent; validation then says what is missing), and the tokenizer's
    sha256 (recorded in checkpoints, so eval and sample can refuse a retrained tokenizer)."""
    tok_dir = rundir.tokenizer_dir(cfg.run)
    meta = load_meta(tok_dir)
    vocab = int(meta["vocab_size"])
    manifest = load_manifest(rundir.shards_dir(cfg.run))
    m_vocab = int(manifest.get("tokenizer", {}).get("vocab_size", vocab))
    if m_vocab != vocab:  # the run's data do not match: bad data (exit 1), as a sha256 mismatch
        raise ValueError(
            f"{fsio.join(rundir.shards_dir(cfg.run), 'manifest.json')}: shards were made with "
            f"vocab_size {m_vocab}, but the tokenizer in {tok_dir} has {vocab}; "
            "re-run `codex data shard`"
        )
    m_sha = manifest.get("tokenizer", {}).get("sha256")
    if m_sha and meta.get("sha256") and m_sha != meta["sha256"]:
        raise ValueError(
            f"{fsio.join(rundir.shards_dir(cfg.run), 'manifest.json')}: shards were made with "
            f"another tokenizer ({m_sha[:12]}) than {tok_dir} ({meta['sha256'][:12]}); "
            "re-run `codex data shard`"
        )
    if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} but the run's tokenizer has {vocab} tokens; "
            "leave model.vocab_size at 0 (taken from the tokenizer)"
        )
    token_bytes = None
    if fsio.exists(fsio.join(tok_dir, TOKEN_BYTES_FILE)):
        token_bytes = torch.from_numpy(load_token_bytes(tok_dir).astype(np.int64))
    return vocab, token_bytes, str(meta.get("sha256", ""))
