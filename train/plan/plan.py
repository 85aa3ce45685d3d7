"""The run's plan: what training derives once from the config, the hardware preset and the run's
files (tokenizer, shard manifest), before the first step.

    cfg, plan, token_bytes = make_plan(cfg, preset, world_size)

Batch: train.batch_tokens tokens per optimizer step = device_batch * seq_len * world * accum
(train/plan/batch.py: grad_accum_steps decides accum, and says which values divide); the device
batch and sequence length default to the memory plan's (train/plan/memory.py), and a setting the
plan says cannot fit is refused (exit 2). train/plan/hardware.py: choose_batch decides them, for
the run and for `codex train --help` alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from codex.core import fsio, rundir
from codex.core.config import Config, ConfigError
from codex.core.config.train import DEFAULT_LR
from codex.model.gpt import mlp_hidden
from codex.pipeline.tokenizer.tokenizer import TOKEN_BYTES_FILE, load_meta, load_token_bytes
from codex.train.data.token_shards import load_manifest

# the Plan's accumulation rule, defined in batch.py so that choose_batch (hardware.py) reaches it
from codex.train.plan.batch import grad_accum_steps as grad_accum_steps
from codex.train.plan.hardware import HardwarePreset, choose_batch
from codex.train.plan.layout import Layout, layout_for
from codex.train.plan.memory import MemoryPlan, check_fits


def resolve_batch(
    cfg: Config, preset: HardwarePreset, world_size: int
) -> tuple[int, int, int, int, MemoryPlan, Layout]:
    """(device_batch, seq_len, accum, batch_tokens, memory plan, layout) from codex.train.* and the
    hardware preset defaults (train/plan/hardware.py: choose_batch decides the batch, the layout
    and the accumulation); a setting whose memory plan cannot fit this machine is refused
    (exit 2)."""
    b = choose_batch(cfg, preset, world_size)
    memory = check_fits(
        cfg.model, preset, b.device_batch, b.seq_len, b.setting, cfg.train.batch_tokens
    )
    layout = layout_for(b.setting.layout, b.setting.fsdp_size, world_size)
    # fsdp: keep the gathered weights from forward to backward (ZeRO-2) where the plan fits them
    layout = replace(layout, reshard_after_forward=memory.reshard_after_forward)
    return b.device_batch, b.seq_len, b.accum, b.batch_tokens, memory, layout


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


def make_plan(
    cfg: Config, preset: HardwarePreset, world_size: int, vocab: int | None = None
) -> tuple[Config, Plan, torch.Tensor | None]:
    """(the resolved config, the Plan, token_bytes). The resolved config carries the tokenizer's
    vocab size, the MLP width (so a later change of the derivation cannot change a saved model's
    shape) and the learning rate (train.lr 0 = the optimizer's default): it is what checkpoints
    record and what eval rebuilds the model from. vocab: given, no run files are read (a compile
    of the step before any data exists, train/compile_only.py)."""
    if vocab is None:
        vocab, token_bytes, tokenizer_sha = _read_vocab(cfg)
    else:
        token_bytes, tokenizer_sha = None, ""
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


def _read_vocab(cfg: Config) -> tuple[int, torch.Tensor | None, str]:
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
