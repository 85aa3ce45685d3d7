"""The network: a decoder-only transformer in one readable file (nanoGPT / nanochat style).

    idx -> wte -> [block] * n_layer -> RMSNorm -> lm_head -> logits[..., :vocab_size]
    block: x + attn(norm(x)),  x + mlp(norm(x))

attn: QK-norm, RoPE, GQA, causal attention by model.attention (model/attention.py); mlp: SwiGLU or
ReLU^2; optional value embeddings. Generation keeps a KV cache of fixed shapes (KVCache, prefill,
decode), and everything here also lowers under torch_xla. Precision, padding, the KV cache and
what XLA needs: docs/training.md, "The network".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

# the shape arithmetic lives beside ModelConfig, so the memory plan (train/plan/memory.py) and
# `codex train --help` compute it without importing torch; imported here for the model's use
from codex.core.config.model import (
    ModelConfig,
    has_value_embed,
    matmul_params,
    mlp_hidden,
    padded_vocab,
)
from codex.model.attention import causal_attention
from codex.model.attention import sdpa_causal as sdpa_causal  # SDPA's causal call, re-exported


def check_config(cfg: ModelConfig) -> None:
    """Raise ValueError naming the model.* key that makes the shapes impossible."""
    if cfg.vocab_size <= 0:
        raise ValueError(
            "model.vocab_size must be set (> 0); it is normally taken from the run's tokenizer"
        )
    if cfg.n_embd % cfg.n_head:
        raise ValueError(
            f"model.n_embd ({cfg.n_embd}) must be divisible by model.n_head ({cfg.n_head})"
        )
    if (cfg.n_embd // cfg.n_head) % 2:
        raise ValueError(
            f"head dim n_embd/n_head = {cfg.n_embd // cfg.n_head} must be even for rotary "
            "embeddings"
        )
    if cfg.n_kv_head <= 0 or cfg.n_head % cfg.n_kv_head:
        raise ValueError(
            f"model.n_head ({cfg.n_head}) must be a multiple of model.n_kv_head ({cfg.n_kv_head})"
        )
    if cfg.n_layer <= 0 or cfg.max_seq_len <= 0:
        raise ValueError("model.n_layer and model.max_seq_len must be positive")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.dtype == torch.float32:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        # bf16 activations: the mean of squares accumulated in fp32 (a bf16 sum of squares loses
        # precision), the output in x's dtype. vector_norm(dtype=fp32) reads x without an fp32
        # [B, T, d] copy kept for the backward (it saves x itself), as x.float() would.
        ms = (
            torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).square()
            / x.shape[-1]
        )
        return x * torch.rsqrt(ms + self.eps).to(x.dtype) * self.weight.to(x.dtype)


def rope_cache(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq_len, head_dim // 2] (fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    """x [B, H, T, D]; rotate the pairs (x[..., i], x[..., i + D/2]) by position-dependent
    angles."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # model.attention's kernel on the device it runs on; GPT.set_attention swaps in a
        # backend's (same function, other hardware)
        self.attend = causal_attention(cfg.attention)
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_q = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)
        # QK-norm (per head, before RoPE) keeps attention logits bounded at high learning rates.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def qkv(self, x, cos, sin, ve=None):
        """q [B, n_head, T, hd], k and v [B, n_kv_head, T, hd]; q and k after QK-norm and RoPE;
        ve [B, T, n_kv_head * hd], the layer's value embedding of the tokens, added to v."""
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x) if ve is None else self.c_v(x) + ve.to(x.dtype)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin), v

    def forward(self, x, cos, sin, ve=None):
        return self.prefill(x, cos, sin, ve)[0]

    def prefill(self, x, cos, sin, ve=None):
        """The causal attention over a whole sequence, and its k, v for a KV cache."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin, ve)
        y = self.attend(q, k, v)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1)), k, v

    def decode(self, x, cos, sin, kv, pos, mask, ve=None):
        """One new token x [B, 1, C] at position `pos` (a 1-element long tensor): writes its k, v
        into this layer's cache kv [2, B, n_kv_head, max_len, hd] at `pos` and attends over the
        whole buffer with `mask` [max_len] (True at positions 0..pos). Every shape is fixed, so
        under XLA one compiled program serves every position.

        7 parameters: one decode step's per-layer pieces (input, rotary cos/sin, this layer's cache,
        position, mask, value embedding), as plain tensors of fixed shapes."""
        B = x.shape[0]
        q, k, v = self.qkv(x, cos, sin, ve)
        kv[0].index_copy_(2, pos, k.to(kv.dtype))
        kv[1].index_copy_(2, pos, v.to(kv.dtype))
        y = F.scaled_dot_product_attention(
            q,
            kv[0].to(q.dtype),
            kv[1].to(q.dtype),
            attn_mask=mask,
            enable_gqa=self.n_kv_head != self.n_head,
        )
        return self.c_proj(y.transpose(1, 2).reshape(B, 1, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = mlp_hidden(cfg)
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.w_gate = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.w_up = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.w_down = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        if self.kind == "swiglu":
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return self.w_down(F.relu(self.w_up(x)).square())


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, ve=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, ve)
        return x + self.mlp(self.mlp_norm(x))

    def prefill(self, x, cos, sin, ve=None):
        a, k, v = self.attn.prefill(self.attn_norm(x), cos, sin, ve)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), k, v

    def decode(self, x, cos, sin, kv, pos, mask, ve=None):
        """Attention.decode after the norm, then the MLP: one new token through this block.

        7 parameters: one decode step's per-layer pieces (input, rotary cos/sin, this layer's
        cache, position, mask, value embedding), as plain tensors of fixed shapes."""
        x = x + self.attn.decode(self.attn_norm(x), cos, sin, kv, pos, mask, ve)
        return x + self.mlp(self.mlp_norm(x))


# The module a backend may keep the blocks' weights in, stacked: one [n_layer, ...] Parameter per
# block weight name, the blocks' own slots empty (XLA fsdp: train/xla/layer_scan.py). Checkpoints
# keep the per-layer names (train/checkpoint/state.py).
STACKED = "stacked_blocks"


class GPT(nn.Module):
    rope_cos: torch.Tensor  # buffers (register_buffer in __init__)
    rope_sin: torch.Tensor
    # runner(model, x, cos, sin, idx) -> the last block's output, in place of the Python loop over
    # the blocks: XLA fsdp's one scanned layer over stacked weights (train/xla/layer_scan.py)
    blocks_runner: Callable | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_config(cfg)
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.padded_vocab = padded_vocab(cfg.vocab_size)
        self.wte = nn.Embedding(self.padded_vocab, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        kv_dim = cfg.n_kv_head * (cfg.n_embd // cfg.n_head)
        self.value_embeds = nn.ModuleDict(
            {
                str(i): nn.Embedding(self.padded_vocab, kv_dim)
                for i in range(cfg.n_layer)
                if has_value_embed(cfg, i)
            }
        )
        self.norm_f = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, self.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        # Not persistent: derived from the config, so checkpoints hold only learned weights.
        cos, sin = rope_cache(cfg.max_seq_len, cfg.n_embd // cfg.n_head, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, *args, **kwargs):
        # Moving to a device whose tensors cannot share storage with CPU ones (XLA, meta -> CPU)
        # makes a new Parameter per module and silently unties wte and lm_head: tie them again.
        super()._apply(fn, *args, **kwargs)
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        return self

    def set_attention(self, attend) -> None:
        """Every block's causal attention through attend(q, k, v) -> [B, H, T, D] instead of
        model.attention's own (the backend's kernel, e.g. flash on TPU). Generation's decode step
        keeps SDPA: it attends one query over a masked cache."""
        for block in self.blocks:
            cast(Block, block).attn.attend = attend

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 style: N(0, init_std) everywhere, residual output projections scaled by
        1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth; norms 1.
        Draws only from `generator`, so the result depends on the seed alone."""
        for name, p in self.named_parameters():  # named_parameters yields a tied weight once
            init_parameter(self.cfg, name, p, generator)
        cos, sin = rope_cache(
            self.cfg.max_seq_len, self.cfg.n_embd // self.cfg.n_head, self.cfg.rope_theta
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def value_embedding(self, layer: int, idx: torch.Tensor) -> torch.Tensor | None:
        table = self.value_embeds[str(layer)] if str(layer) in self.value_embeds else None
        return None if table is None else table(idx)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The token embeddings, in the compute dtype: under autocast (bf16 on CUDA and TPU, or
        train.dtype=bf16) the residual stream and the norms' outputs are bf16 while the weights
        stay fp32 (autocast casts them inside each linear); without autocast, fp32 throughout."""
        x = self.wte(idx)
        device_type = idx.device.type
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm, the output head sliced to the real vocab, and the soft-cap when set:
        cap * tanh(logits / cap) keeps every logit inside (-cap, cap) (Gemma 2, modded-nanogpt)."""
        logits = self.lm_head(self.norm_f(x))[..., : self.vocab_size]
        cap = self.cfg.logit_softcap
        return cap * torch.tanh(logits / cap) if cap > 0 else logits

    def forward(self, idx, targets=None, reduction: str = "mean"):
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} > model.max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        if targets is not None and reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        x = self.run_blocks(self.embed(idx), cos, sin, idx)
        if targets is None:
            return self.logits(x)
        return self.head_loss(x, targets, reduction)

    def run_blocks(self, x, cos, sin, idx):
        """x through every block in order (their value embeddings of idx added), or through
        blocks_runner when a backend set one."""
        if self.blocks_runner is not None:
            return self.blocks_runner(self, x, cos, sin, idx)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, self.value_embedding(i, idx))
        return x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
        """The final norm, the head and the cross-entropy of the last block's output x [B, T, d]
        against targets [B, T] (-1 = ignored): the mean loss, or per-token losses [B, T] (fp32)
        with reduction="none". One method so that train/distributed/fsdp.py can torch.compile it as
        one
        function (the blocks are compiled one by one there; the whole model under replicate)."""
        B, T = targets.shape
        # fp32 cross-entropy: bf16 log-softmax over a 32K+ vocab loses ~2 digits of the loss.
        loss = F.cross_entropy(
            self.logits(x).float().reshape(-1, self.vocab_size),
            targets.reshape(-1),
            ignore_index=-1,
            reduction=reduction,
        )
        return loss.view(B, T) if reduction == "none" else loss


# --- generation with a KV cache -------------------------------------------------------------------


@dataclass
class KVCache:
    """Every layer's keys and values of the tokens generated so far, preallocated to max_len so
    the decode step has the same shapes at every position (one XLA program, no reallocation).

    kv:  [n_layer, 2, B, n_kv_head, max_len, head_dim]: K (after QK-norm and RoPE) and V of
         positions 0..pos-1, zeros beyond (masked out). GQA caches only the n_kv_head shared heads.
    pos: a 1-element long tensor on the model's device, the next position to write. It stays on
         the device so XLA reads it as data, not as a constant baked into the program.
    """

    kv: torch.Tensor
    pos: torch.Tensor

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]


@torch.no_grad()
def prefill(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
    """Run the prompt idx [B, T] (T <= max_seq_len, positions 0..T-1, as the training forward)
    and return the logits of its last position [B, vocab_size] and the cache of its K/V."""
    B, T = idx.shape
    L = model.cfg.max_seq_len
    if T > L:
        raise ValueError(f"prefill: prompt length {T} > model.max_seq_len {L}")
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.embed(idx)
    kvs = []
    for i, block in enumerate(model.blocks):
        x, k, v = cast(Block, block).prefill(x, cos, sin, model.value_embedding(i, idx))
        kvs.append(torch.stack([k, v]))
    kv = F.pad(torch.stack(kvs), (0, 0, 0, L - T))  # zero positions T..L-1 of dim 4
    pos = torch.full((1,), T, dtype=torch.long, device=idx.device)
    return model.logits(x[:, -1]), KVCache(kv, pos)


@torch.no_grad()
def decode(model: GPT, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Append token [B, 1] at position cache.pos (< max_len) to the cache and return the logits
    of the next token [B, vocab_size]: the same as the full forward's last position over the
    tokens so far. Advances cache.pos by one, on the device."""
    pos = cache.pos
    cos, sin = model.rope_cos.index_select(0, pos), model.rope_sin.index_select(0, pos)
    mask = (torch.arange(cache.max_len, device=pos.device) <= pos).view(1, 1, 1, -1)
    x = model.embed(token)
    for i, block in enumerate(model.blocks):
        x = cast(Block, block).decode(
            x, cos, sin, cache.kv[i], pos, mask, model.value_embedding(i, token)
        )
    cache.pos = pos + 1
    return model.logits(x[:, -1])


@torch.no_grad()
def init_parameter(
    cfg: ModelConfig, name: str, p: torch.Tensor, generator: torch.Generator
) -> None:
    """GPT.init_weights' rule for one parameter, drawn from `generator` (train/distributed/fsdp.py
    replays
    it parameter by parameter to initialise a sharded model exactly as build_model would)."""
    std = cfg.init_std
    if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        p.fill_(1.0)
    elif name.startswith("value_embeds."):  # the scale of the values it is added to
        p.normal_(0.0, cfg.n_embd**-0.5, generator=generator)
    elif name.endswith("c_proj.weight") or name.endswith("w_down.weight"):
        if cfg.zero_init_proj:  # every block starts as the identity on the residual stream
            p.zero_()
        else:
            p.normal_(0.0, std / math.sqrt(2 * cfg.n_layer), generator=generator)
    else:
        p.normal_(0.0, std, generator=generator)


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """The model on the CPU with weights drawn from `seed` only: every rank calling this with the
    same seed gets bit-identical weights, whatever the global RNG state (which is left untouched).

    Modules are created on the meta device (no wasted default init of a 1B model), then
    materialised on the CPU and initialised from a local generator. The backend moves the model
    to its device afterwards.
    """
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to_empty(device="cpu")  # GPT._apply keeps wte and lm_head tied
    model.init_weights(torch.Generator(device="cpu").manual_seed(int(seed)))
    return model


def num_params(model: nn.Module) -> int:
    """Unique parameters (a tied embedding/head matrix counts once)."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) for MFU, in MaxText's convention: 6 * N
    (N = matmul parameters, embedding lookups excluded) + 6 * L * H * head_dim * T for the
    attention scores and the weighted sum of values, the full square's 12 * L * H * head_dim * T
    (PaLM, nanochat) halved for the causal mask: a token attends to the positions up to it."""
    hd = cfg.n_embd // cfg.n_head
    return 6.0 * matmul_params(cfg) + 6.0 * cfg.n_layer * cfg.n_head * hd * seq_len
