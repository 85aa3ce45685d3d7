"""Model settings (`model.*`). Size presets live in configs/model/*.yaml (`codex train --model NAME`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ModelConfig:
    preset: str = ""          # the configs/model/NAME.yaml these settings start from (--model NAME); "" = none
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4        # < n_head: grouped-query attention
    n_embd: int = 128
    mlp: Literal["swiglu", "relu2"] = "swiglu"
    mlp_hidden: int = 0       # 0: derived (swiglu: 8/3 * n_embd rounded up to 64; relu2: 4 * n_embd)
    qk_norm: bool = True
    tie_embeddings: bool = False
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    vocab_size: int = 0       # 0: taken from the run's tokenizer; padded to a multiple of 128
    max_seq_len: int = 1024
    init_std: float = 0.02
    zero_init_proj: bool = False   # attention and MLP output projections start at zero (modded-nanogpt)
    logit_softcap: float = 0.0     # > 0: logits = cap * tanh(logits / cap); 0 = off
    value_embed: bool = False      # alternate layers add a per-token value embedding to V (modded-nanogpt, nanochat)
