"""A first memory estimate for one training process, so that a batch that cannot fit is refused
before training starts (exit 2 with the estimate and the fix) instead of being OOM-killed minutes
later.

    weights + gradients + AdamW moments   16 bytes per parameter (fp32 master weights)
    activations kept for backward         per layer and token: ~(10 d + 4 h) values (d = n_embd,
                                          h = MLP hidden)
    logits                                B x T x vocab fp32, about 3 copies (logits, log-softmax,
                                          their gradient)

It is meant as a floor, so that only what certainly cannot fit is refused: the attention scores
(n_head x T per token and layer) are not counted, because SDPA's fused kernels never hold them on
CUDA or on the CPU (measured there: the peak does not change with T at a fixed B x T), and on XLA,
whose math decomposition does hold them, the compiler may rematerialise. Measured peak RSS of one
fp32 CPU step (model/gpt.py + AdamW), against this estimate:

    default 4x128, vocab 256,   B x T = 256 x 256 / 64 x 1024 / 16 x 4096   4.46 / 4.53 / 4.42 GB, estimate 3.17
    default 4x128, vocab 8192,  B x T = 32 x 256                             1.51 GB, estimate 1.22
    124m,          vocab 8192,  B x T = 2 x 512                              2.71 GB, estimate 2.44

Allocator slack, workspaces and the transient gradients of backward come on top; the
sharded-state work replaces this with a full memory plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from codex.config import ConfigError
from model.gpt import matmul_params, mlp_hidden, padded_vocab


@dataclass
class Estimate:
    state_bytes: int        # weights, gradients, AdamW moments
    activation_bytes: int   # kept for backward, all layers, one micro-batch
    logits_bytes: int

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes + self.logits_bytes


def param_count(m) -> int:
    """Parameters of model.gpt.GPT for ModelConfig `m`: the matmul weights (output head over the
    padded vocab included) plus the embedding table when it is not tied to the head."""
    return matmul_params(m) + (0 if m.tie_embeddings else padded_vocab(m.vocab_size) * m.n_embd)


def estimate(m, device_batch: int, seq_len: int, act_bytes: int = 4) -> Estimate:
    """Bytes one process needs at least to train ModelConfig `m` on micro-batches of
    device_batch x seq_len (act_bytes: 4 in fp32, 2 under bf16 autocast)."""
    tokens = device_batch * seq_len
    per_token_layer = (10 * m.n_embd + 4 * mlp_hidden(m)) * act_bytes
    return Estimate(state_bytes=16 * param_count(m),
                    activation_bytes=m.n_layer * tokens * per_token_layer,
                    logits_bytes=3 * tokens * m.vocab_size * 4)


def available_bytes(kind: str, preset_memory_gb: float) -> int | None:
    """Memory one process may use: the GPU's own total memory when CUDA is up (an A100 may have 40
    or 80 GB), else the preset's device memory on accelerators; MemAvailable divided by the
    processes on this host on the CPU; None when unknown."""
    if kind == "cuda":
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    if kind in ("cuda", "tpu"):
        return int(preset_memory_gb * 1e9) if preset_memory_gb > 0 else None
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: line.split()[1] for line in f}
        return int(info["MemAvailable"]) * 1024 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except (OSError, KeyError, ValueError):
        return None


def resolve_layout(tcfg, m, device_batch: int, seq_len: int, kind: str, preset_memory_gb: float, act_bytes: int,
                   world_size: int):
    """train.parallel / train.fsdp_size -> a train.fsdp.Layout for world_size ranks. auto: replicate
    when the replicated estimate fits, else fsdp over every rank. (The memory plan of issue 14
    replaces this floor estimate; it plugs in here.)"""
    from train.fsdp import Layout

    parallel, size = tcfg.parallel, tcfg.fsdp_size
    if kind == "tpu" and parallel == "fsdp":
        raise ConfigError("train.parallel=fsdp is not available on TPU presets yet (SPMD sharding is separate work); "
                          "use train.parallel=replicate (or auto)")
    if parallel == "auto":
        avail = available_bytes(kind, preset_memory_gb)
        fits = avail is None or estimate(m, device_batch, seq_len, act_bytes).total <= avail
        parallel = "replicate" if fits or world_size == 1 or kind == "tpu" else "fsdp"
    if parallel == "replicate" or world_size == 1:
        # One process: sharding over one rank is the replicated layout.
        return Layout("replicate")
    size = size or world_size
    if size > world_size or world_size % size:
        raise ConfigError(f"train.fsdp_size={size} must divide the world size {world_size} "
                          f"(0 = all {world_size} ranks)")
    return Layout("fsdp", shard=size, replicas=world_size // size)


def check_fits(m, device_batch: int, seq_len: int, kind: str, preset_memory_gb: float, act_bytes: int,
               shards: int = 1) -> Estimate:
    """The estimate, or a ConfigError (exit 2) naming the keys and the fix when it cannot fit.
    shards: ranks the weights, gradients and optimizer state are sharded over (fsdp)."""
    est = estimate(m, device_batch, seq_len, act_bytes)
    est.state_bytes //= shards
    avail = available_bytes(kind, preset_memory_gb)
    if avail is not None and est.total > avail:
        where = "available on this machine" if kind == "cpu" else "per device"
        raise ConfigError(
            f"train.device_batch={device_batch} x train.seq_len={seq_len} needs at least {est.total / 1e9:.1f} GB "
            f"(weights+grads+AdamW {est.state_bytes / 1e9:.1f}, activations {est.activation_bytes / 1e9:.1f}, "
            f"logits {est.logits_bytes / 1e9:.1f}) but {avail / 1e9:.1f} GB is {where}; lower --device-batch "
            "(keep --batch-tokens: gradient accumulation makes up the rest) or --seq-len"
            + ("" if shards > 1 else ", or shard the state over several devices (train.parallel=fsdp)"))
    return est
