"""The model's causal attention: which kernel runs (`attention_kind`, the one rule for
model.attention: auto, sdpa, flash or blockwise) and blockwise attention in plain tensor ops
(`blockwise_causal`).

Blockwise is for XLA where the Pallas flash kernel cannot run: XLA lowers SDPA to its math form,
whose fp32 [B, H, T, T] probabilities dominate a step's memory from T ~ 1024. It computes the same
function as flash does (query blocks, online softmax, its own backward that recomputes each block),
never repeats K/V for GQA, and accumulates in fp32. The kinds and the algorithm: docs/tpu.md,
"Flash attention on TPU".
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

KINDS = ("auto", "sdpa", "flash", "blockwise")

# The largest query / key block blockwise_causal picks itself: a multiple of 128 (the MXU's and
# the vector unit's lane width on TPU), and a [Bq, Bk] fp32 score block of 1 MiB per head.
MAX_BLOCK = 512


def attention_kind(requested: str, device_type: str, pallas: bool = False) -> str:
    """THE rule for model.attention: the kernel that runs for `requested` on a device of
    `device_type` ("cuda", "cpu", "xla", ...); `pallas`: torch_xla's Pallas flash kernel can run
    here (a TPU with JAX; only the XLA backend knows). auto: flash on XLA with Pallas, blockwise on
    XLA without it (SDPA would be the math path there), SDPA elsewhere (its fused kernels)."""
    if requested not in KINDS:
        raise ValueError(f"model.attention must be one of {KINDS}, got {requested!r}")
    if requested != "auto":
        return requested
    if device_type != "xla":
        return "sdpa"
    return "flash" if pallas else "blockwise"


def sdpa_causal(q, k, v):
    """Causal attention of q [B, H, T, D] over k, v [B, n_kv_head, T, D] (model.attention=sdpa).
    enable_gqa: CUDA's flash kernel reads the n_kv_head shared K/V heads without copies; the math
    path (torch_xla 2.9 lowers SDPA to it) repeats K/V per query head and holds the [B, H, T, T]
    scores."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
    )


def attend(requested: str, q, k, v):
    """The model's attention for model.attention=`requested` when no backend installed a kernel
    (GPT.set_attention): SDPA or blockwise by attention_kind on q's device. flash here means the
    backend has not installed it (a model built outside a TPU backend): SDPA."""
    if attention_kind(requested, q.device.type) == "blockwise":
        return blockwise_causal(q, k, v)
    return sdpa_causal(q, k, v)


def causal_attention(requested: str):
    """attend(q, k, v) for model.attention=`requested` (a partial: a module holding it still
    pickles and deep-copies)."""
    attention_kind(requested, "cpu")  # an unknown value fails when the model is built
    return functools.partial(attend, requested)


def default_block(seq_len: int) -> int:
    """The query and key block blockwise_causal uses for `seq_len` positions: 4 to 8 blocks per
    sequence (4 already skip 3/8 of the score work, the masked blocks; the graph holds
    n (n + 1) / 2 block pairs per layer, so more blocks cost tracing and compile time for little),
    at most MAX_BLOCK unless that would take more than 8, and at least 16 positions."""
    return min(seq_len, max(16, seq_len // 8, min(MAX_BLOCK, seq_len // 4)))


def blockwise_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int = 0, block_k: int = 0
) -> torch.Tensor:
    """Causal attention of q [B, H, T, D] over k, v [B, n_kv_head, T, D] (H a multiple of
    n_kv_head, query head h reading K/V head h // (H / n_kv_head), as SDPA's enable_gqa), scale
    1/sqrt(D), without any [.., T, T] tensor (docs/tpu.md). block_q, block_k: the query and
    key block sizes; 0 = default_block(T). They need not divide T (the last block is shorter)."""
    T = q.shape[2]
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} K/V heads")
    bq = block_q or default_block(T)
    bk = block_k or default_block(T)
    return _BlockwiseCausal.apply(q, k, v, bq, bk)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _blocks(length: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, length)) for s in range(0, length, size)]


def _scores(qi, kj, qs: int, qe: int, ks: int, ke: int, group: int):
    """qi [B, KV, G*n, D] (scaled) @ kj^T: the fp32 scores [B, KV, G*n, kb] of query positions
    qs..qe-1 (each group member's n rows in turn) against key positions ks..ke-1, later keys
    masked to -inf where the block crosses the diagonal.

    7 parameters: the two blocks and their position ranges, and the group that stacks rows."""
    s = qi @ kj.transpose(-1, -2)
    if ke - 1 <= qs:  # every key at or before every query: nothing to mask
        return s
    rows = torch.arange(qs, qe, device=s.device)
    cols = torch.arange(ks, ke, device=s.device)
    allowed = (cols[None, :] <= rows[:, None]).repeat(group, 1)  # [G*n, kb]
    return s.masked_fill(~allowed, float("-inf"))


def _grouped(q, k, v):
    """q as [B, KV, G, T, D] (the G query heads that share each K/V head together), k and v, all
    in the accumulation dtype: what the forward and the backward both iterate over."""
    B, H, T, D = q.shape
    KV, acc_t = k.shape[1], _acc_dtype(q.dtype)
    return q.to(acc_t).reshape(B, KV, H // KV, T, D), k.to(acc_t), v.to(acc_t)


class _BlockwiseCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_q: int, block_k: int):
        B, H, T, D = q.shape
        KV, G, scale = k.shape[1], H // k.shape[1], 1.0 / math.sqrt(D)
        with torch.autocast(q.device.type, enabled=False):
            qf, kf, vf = _grouped(q, k, v)
            outs, lses = [], []
            for qs, qe in _blocks(T, block_q):
                n = qe - qs
                qi = qf[:, :, :, qs:qe].reshape(B, KV, G * n, D) * scale
                # key block 0 first: it holds key 0, visible to every query, so the running
                # max is finite from the start
                s = _scores(qi, kf[:, :, :block_k], qs, qe, 0, min(block_k, T), G)
                m = s.amax(-1)
                p = torch.exp(s - m[..., None])
                total, acc = p.sum(-1), p @ vf[:, :, :block_k]
                for ks, ke in _blocks(T, block_k)[1:]:
                    if ks >= qe:  # this key block and the rest: after every query of the block
                        break
                    s = _scores(qi, kf[:, :, ks:ke], qs, qe, ks, ke, G)
                    m_new = torch.maximum(m, s.amax(-1))
                    alpha = torch.exp(m - m_new)
                    p = torch.exp(s - m_new[..., None])
                    total = total * alpha + p.sum(-1)
                    acc = acc * alpha[..., None] + p @ vf[:, :, ks:ke]
                    m = m_new
                outs.append((acc / total[..., None]).reshape(B, KV, G, n, D))
                lses.append((m + torch.log(total)).reshape(B, KV, G, n))
            out = torch.cat(outs, dim=3).reshape(B, H, T, D).to(q.dtype)
            lse = torch.cat(lses, dim=3)  # [B, KV, G, T]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks = (block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        block_q, block_k = ctx.blocks
        B, H, T, D = q.shape
        KV, G, scale = k.shape[1], H // k.shape[1], 1.0 / math.sqrt(D)
        acc_t = _acc_dtype(q.dtype)
        with torch.autocast(q.device.type, enabled=False):
            qf, kf, vf = _grouped(q, k, v)
            do = dout.to(acc_t).reshape(B, KV, G, T, D)
            # D_i = rowsum(dO * O): the softmax's backward term per query (as flash's backward)
            delta = (do * out.to(acc_t).reshape(B, KV, G, T, D)).sum(-1)
            key_blocks = _blocks(T, block_k)
            dk = [None] * len(key_blocks)
            dv = [None] * len(key_blocks)
            dqs = []
            for qs, qe in _blocks(T, block_q):
                n = qe - qs
                qi = qf[:, :, :, qs:qe].reshape(B, KV, G * n, D) * scale
                doi = do[:, :, :, qs:qe].reshape(B, KV, G * n, D)
                lse_i = lse[..., qs:qe].reshape(B, KV, G * n, 1)
                delta_i = delta[..., qs:qe].reshape(B, KV, G * n, 1)
                dqi = None
                for j, (ks, ke) in enumerate(key_blocks):
                    if ks >= qe:
                        break
                    kj, vj = kf[:, :, ks:ke], vf[:, :, ks:ke]
                    p = torch.exp(_scores(qi, kj, qs, qe, ks, ke, G) - lse_i)
                    dvj = p.transpose(-1, -2) @ doi
                    ds = p * (doi @ vj.transpose(-1, -2) - delta_i)
                    dqij = ds @ kj
                    dkj = ds.transpose(-1, -2) @ qi  # qi carries the scale already
                    dqi = dqij if dqi is None else dqi + dqij
                    dk[j] = dkj if dk[j] is None else dk[j] + dkj
                    dv[j] = dvj if dv[j] is None else dv[j] + dvj
                assert dqi is not None
                dqs.append((dqi * scale).reshape(B, KV, G, n, D))
            dq = torch.cat(dqs, dim=3).reshape(B, H, T, D)
            dk_all = torch.cat(dk, dim=2)
            dv_all = torch.cat(dv, dim=2)
        return dq.to(q.dtype), dk_all.to(k.dtype), dv_all.to(v.dtype), None, None
