"""Model settings (`model.*`). Size presets live in configs/model/*.yaml
(`codex train --model NAME`). The shape arithmetic (MLP width, padded vocab, matmul parameters) is
here too, without torch: model/gpt.py builds the network from it, train/plan/memory.py plans
memory with it, and `codex train --help` shows it before anything heavy is imported."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from codex.core.config.setting import setting


@dataclass
class ModelConfig:
    preset: str = setting(
        "", 'The configs/model/NAME.yaml these settings start from (--model NAME); "" = none.'
    )
    depth: int = setting(
        0, "One knob for the shape (with_depth): n_layer, n_embd and heads; 0 = off.", ge=0
    )
    n_layer: int = setting(4, "Transformer blocks.", ge=1)
    n_head: int = setting(4, "Attention heads.", ge=1)
    n_kv_head: int = setting(4, "Key/value heads; fewer than n_head: grouped-query.", ge=1)
    n_embd: int = setting(128, "Width of the residual stream.", ge=1)
    mlp: Literal["swiglu", "relu2"] = setting("swiglu", "The MLP's activation.")
    mlp_hidden: int = setting(
        0,
        "The MLP's width; 0 = derived: swiglu 8/3 d, relu2 4 d (rounded up to 256, or 128).",
        ge=0,
    )
    qk_norm: bool = setting(True, "RMS-normalise queries and keys.")
    attention: Literal["auto", "sdpa", "flash", "blockwise"] = setting(
        "auto",
        "auto: SDPA on CUDA/CPU; on TPU flash where Pallas runs, else blockwise. "
        "flash: torch_xla's Pallas kernel, TPU only. "
        "blockwise: XLA ops, no T x T scores (model/attention.py).",
    )
    tie_embeddings: bool = setting(False, "The output head shares the embedding's weights.")
    rope_theta: float = setting(10_000.0, "Rotary embeddings' base.", gt=0)
    norm_eps: float = setting(1e-6, "RMSNorm's epsilon.", gt=0)
    vocab_size: int = setting(0, "0 = the run's tokenizer's; padded to a multiple of 128.", ge=0)
    max_seq_len: int = setting(1024, "The longest sequence the model takes.", ge=1)
    init_std: float = setting(0.02, "Standard deviation of the weights' init.", gt=0)
    zero_init_proj: bool = setting(
        False, "Attention and MLP output projections start at zero (modded-nanogpt)."
    )
    logit_softcap: float = setting(0.0, "logits = cap * tanh(logits / cap); 0 = off.", ge=0)
    value_embed: bool = setting(
        False, "Alternate layers add a per-token value embedding to V (modded-nanogpt, nanochat)."
    )


def with_depth(m: ModelConfig) -> ModelConfig:
    """model.depth > 0 sets the shape from one number, as nanochat's --depth: n_layer = depth,
    n_embd = 64 x depth rounded up to a multiple of 128, heads of 128 (n_kv_head = n_head). It
    overrides n_layer, n_embd, n_head and n_kv_head. Idempotent, so a checkpoint's config rebuilds
    the same shape. The learning rates do not follow the width (codex/core/config/train.py,
    DEFAULT_LR, says why)."""
    if m.depth <= 0:
        return m
    width = -(-64 * m.depth // 128) * 128
    return dataclasses.replace(
        m, n_layer=m.depth, n_embd=width, n_head=width // 128, n_kv_head=width // 128
    )


# --- shape arithmetic: model/gpt.py, the memory plan and `codex train --help` share it (no torch)


def padded_vocab(vocab_size: int) -> int:
    return ((vocab_size + 127) // 128) * 128


def mlp_hidden(cfg: ModelConfig) -> int:
    """model.mlp_hidden, or derived: SwiGLU 8/3 * d (the parameter count of a 4*d ReLU MLP), ReLU^2
    4 * d, rounded up to a multiple of 256 from 1024 up (whole 256-wide MXU tiles on TPU v6e, and
    tensor-core friendly on GPUs), of 128 below (small models do not grow by a third)."""
    if cfg.mlp_hidden:
        return cfg.mlp_hidden
    hidden = 8 * cfg.n_embd // 3 if cfg.mlp == "swiglu" else 4 * cfg.n_embd
    multiple = 256 if hidden >= 1024 else 128
    return -(-hidden // multiple) * multiple


def has_value_embed(cfg: ModelConfig, layer: int) -> bool:
    """model.value_embed: every other layer, counted back from the last (which always has one)."""
    return cfg.value_embed and layer % 2 == (cfg.n_layer - 1) % 2


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: every weight except the embedding lookup.
    The output head counts (over the padded vocab: those are the FLOPs the hardware does), also
    when tied to the embedding. Norm weights are included (negligible)."""
    d, hd = cfg.n_embd, cfg.n_embd // cfg.n_head
    attn = d * cfg.n_head * hd * 2 + d * cfg.n_kv_head * hd * 2
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * mlp_hidden(cfg)
    norms = 2 * d + (2 * hd if cfg.qk_norm else 0)
    return cfg.n_layer * (attn + mlp + norms) + d + d * padded_vocab(cfg.vocab_size)
