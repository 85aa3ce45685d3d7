"""Model settings (`model.*`). Size presets live in configs/model/*.yaml
(`codex train --model NAME`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


@dataclass
class ModelConfig:
    # the configs/model/NAME.yaml these settings start from (--model NAME); "" = none
    preset: str = ""
    depth: int = 0  # > 0: one knob for the shape (with_depth): n_layer, n_embd, heads
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4  # < n_head: grouped-query attention
    n_embd: int = 128
    mlp: Literal["swiglu", "relu2"] = "swiglu"
    # 0: derived (swiglu 8/3 * n_embd, relu2 4 * n_embd; rounded up to 256, to 128 below 1024)
    mlp_hidden: int = 0
    qk_norm: bool = True
    # flash: torch_xla's Pallas kernel, TPU only (train/xla/flash.py)
    attention: Literal["sdpa", "flash"] = "sdpa"
    tie_embeddings: bool = False
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    vocab_size: int = 0  # 0: taken from the run's tokenizer; padded to a multiple of 128
    max_seq_len: int = 1024
    init_std: float = 0.02
    # attention and MLP output projections start at zero (modded-nanogpt)
    zero_init_proj: bool = False
    logit_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap); 0 = off
    # alternate layers add a per-token value embedding to V (modded-nanogpt, nanochat)
    value_embed: bool = False


def with_depth(m: ModelConfig) -> ModelConfig:
    """model.depth > 0 sets the shape from one number, as nanochat's --depth: n_layer = depth,
    n_embd = 64 x depth rounded up to a multiple of 128, heads of 128 (n_kv_head = n_head). It
    overrides n_layer, n_embd, n_head and n_kv_head. Idempotent, so a checkpoint's config rebuilds
    the same shape. The learning rates do not follow the width (codex/config/train.py DEFAULT_LR
    says why)."""
    if m.depth <= 0:
        return m
    width = -(-64 * m.depth // 128) * 128
    return dataclasses.replace(
        m, n_layer=m.depth, n_embd=width, n_head=width // 128, n_kv_head=width // 128
    )
