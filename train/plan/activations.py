"""What a block keeps for its backward, per token: eager (read off model/gpt.py's Block.forward)
and under torch.compile (read off inductor's forward graph), and the transients beside them.
Summed per device by train/plan/memory.py; the terms are in docs/hardware.md."""

from __future__ import annotations

from codex.core.config.model import ModelConfig, mlp_hidden


def layer_bytes_per_token(m: ModelConfig, compute_bytes: int, attention: str, seq_len: int) -> int:
    """Bytes one block keeps for backward per token, read off model/gpt.py's Block.forward.
    fp32 (no autocast): RMSNorm keeps its input and normalised value, QK-norm the same per head.
    bf16 autocast: the residual stream is bf16 (GPT.embed); each norm keeps its bf16 input, x times
    its fp32-computed scale and its output (the statistics per token are negligible), and the
    linears read that bf16 output as is."""
    d, c = m.n_embd, compute_bytes
    hd = d // m.n_head
    dkv, h = m.n_kv_head * hd, mlp_hidden(m)
    # block input, attn-norm scaled x and output, the residual after attention, mlp-norm's two
    if c < 4:
        norm_in, attn_norm, mid, mlp_norm = c * d, 2 * c * d, c * d, 2 * c * d
        per_qk = 4 * c if m.qk_norm else 2 * c  # projection, (QK-norm's two), RoPE output
    else:
        norm_in, attn_norm, mid, mlp_norm = 4 * d, 8 * d, 4 * d, 8 * d
        per_qk = 16 if m.qk_norm else 8  # projection, normalised, norm output, RoPE output
    q, k, v = per_qk * d, per_qk * dkv, c * dkv
    # fp32 probabilities per head over the T keys, K and V copied to every query head
    if attention == "math":
        sdpa = c * d + 4 * m.n_head * seq_len + (2 * c * d if dkv != d else 0)
    elif attention == "flash":  # the Pallas kernel: fused, on K/V repeated to every query head
        sdpa = c * d + 4 * m.n_head + (2 * c * d if dkv != d else 0)
    else:  # fused: the output and a log-sum-exp per head
        sdpa = c * d + 4 * m.n_head
    attn_out = c * d  # the [B, T, H*hd] copy c_proj reads
    # swiglu: gate, silu(gate), up, product; relu2: relu, square
    mlp = (4 if m.mlp == "swiglu" else 2) * c * h
    return norm_in + attn_norm + q + k + v + sdpa + attn_out + mid + mlp_norm + mlp


def compiled_layer_bytes_per_token(m: ModelConfig, compute_bytes: int) -> int:
    """Bytes one block keeps for backward per token under torch.compile (inductor, fused
    attention): what its forward graph saves, in the compute dtype c (the residual stream's:
    bf16 under autocast). The block input; each norm's output (the linears read it) and its
    per-token fp32 statistic, never its fp32 intermediates; q and k after RoPE, and before it with
    QK-norm (its input, with a statistic per head); v; SDPA's output, its log-sum-exp per head and
    the [T, H*hd] copy c_proj reads; the residual after attention; SwiGLU's gate, up and their
    product (ReLU^2: up and the square). The same on the CPU and CUDA: the partition into forward
    and backward is inductor's, whichever device runs the kernels."""
    d, c = m.n_embd, compute_bytes
    hd = d // m.n_head
    dkv, h = m.n_kv_head * hd, mlp_hidden(m)
    qk = 2 if m.qk_norm else 1  # QK-norm's input, then RoPE's output
    saved = d + d + qk * d + qk * dkv + dkv + d + d + d + d  # input .. attn out copy, mid, norm
    saved += (3 if m.mlp == "swiglu" else 2) * h
    stats = 4 * (2 + ((m.n_head + m.n_kv_head) if m.qk_norm else 0))  # the norms' rsqrt
    return c * saved + stats + 4 * m.n_head  # + SDPA's log-sum-exp


def compiled_workspace_per_token(m: ModelConfig, compute_bytes: int) -> int:
    """The largest transient of one block's compiled backward per token: the gradients of its MLP's
    hidden activations (SwiGLU's gate, up and product; ReLU^2's two) and of the residual stream
    entering and leaving it, in the compute dtype."""
    return compute_bytes * ((3 if m.mlp == "swiglu" else 2) * mlp_hidden(m) + 2 * m.n_embd)


def head_bytes_per_token(m: ModelConfig, compute_bytes: int) -> int:
    """The final norm: the last block's output, its scaled (fp32: normalised) value, and the head's
    input; all three in the residual stream's dtype, bf16 under autocast."""
    return 3 * compute_bytes * m.n_embd


def compiled_head_bytes_per_token(m: ModelConfig, compute_bytes: int) -> int:
    """The final norm under torch.compile: the last block's output and the head's input, in the
    compute dtype, and the norm's fp32 statistic."""
    return 2 * compute_bytes * m.n_embd + 4
