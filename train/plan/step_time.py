"""The modelled step time: how long one optimizer step takes on a TPU slice, from the model's
FLOPs at the chip's bf16 peak, its HBM traffic where that bounds a phase, and the bytes each
parallel layout's collectives move over the chip's ICI links, the next layer's all-gather hidden
behind this layer's compute where the layout runs them async (fsdp's layer loop). The planner
(batch.py) picks the fastest configuration that fits; `codex hardware` shows it. A roofline, not
a measurement: docs/tpu.md, "The step-time model", gives each term and what it leaves out.

    t = step_time(m, preset, memory_plan)   # None off TPU
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from codex.core.config.data import TokenizerConfig
from codex.core.config.model import ModelConfig, matmul_params, padded_vocab
from codex.train.plan.activations import layer_bytes_per_token
from codex.train.plan.memory import Device, MemoryPlan
from codex.train.plan.params import block_params, hidden_matrices, param_count

NS_STEPS = 5  # Muon's Newton-Schulz iterations (train/optim/muon.py's default)


class Chip(Device, Protocol):
    """What the model reads of a preset besides the plan's Device (presets.HardwarePreset)."""

    @property
    def peak_flops(self) -> float: ...
    @property
    def hbm_bandwidth(self) -> float: ...
    @property
    def ici_bandwidth(self) -> float: ...


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on one chip (every chip does the same), by term."""

    step_s: float  # the modelled step: phases in order, hidden collectives not counted
    compute_s: float  # the FLOPs executed (remat's recompute and Muon's iterations included)
    hbm_s: float  # the HBM traffic the model counts, at the chip's bandwidth
    ici_s: float  # every collective's bytes received, at half the chip's ICI bandwidth
    exposed_ici_s: float  # of which not hidden behind compute
    model_flops: float  # per chip per step, MaxText's convention: MFU's numerator
    peak_flops: float  # the chip's bf16 peak

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.peak_flops * self.step_s) if self.step_s > 0 else 0.0

    @property
    def bound(self) -> str:
        """What the step spends most on: compute, HBM or ICI (exposed)."""
        terms = {"compute": self.compute_s, "HBM": self.hbm_s, "ICI": self.exposed_ici_s}
        return max(terms, key=lambda k: terms[k])


def model_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token in MaxText's convention, as model/gpt.py's flops_per_token (which
    needs torch): 6 N for the matmul weights + 6 L H hd T, causal attention's half square."""
    hd = m.n_embd // m.n_head
    return 6.0 * matmul_params(m) + 6.0 * m.n_layer * m.n_head * hd * seq_len


def modelled(preset: Device) -> bool:
    """Whether the model can time a step on `preset` (presets.HardwarePreset.has_step_model: a
    TPU with its chip's bandwidths)."""
    return bool(getattr(preset, "has_step_model", False))


def _ring(n: int) -> float:
    """The share of a collective's whole size each of n chips receives in a gather or scatter."""
    return (n - 1) / n if n > 1 else 0.0


@dataclass(frozen=True)
class _Chip:
    peak: float
    hbm: float
    ingress: float  # bytes/s a chip receives: half its bidirectional ICI bandwidth

    def run(self, flops: float, nbytes: float) -> float:
        """A phase's seconds: the slower of its FLOPs at the peak and its bytes at HBM speed."""
        return max(flops / self.peak, nbytes / self.hbm)


def _layer(m: ModelConfig, p: MemoryPlan, c: int) -> tuple[float, float, float]:
    """(forward FLOPs, forward HBM bytes, weight bytes) of one block for one micro-batch on a
    chip: matmuls 2 FLOPs a weight a token, causal attention 2 H hd T a token; the bytes of the
    compute-dtype weights read once and of the activations the backward keeps written once
    (activations.py)."""
    tokens, T = p.device_batch * p.seq_len, p.seq_len
    hd = m.n_embd // m.n_head
    flops = tokens * (2.0 * block_params(m) + 2.0 * m.n_head * hd * T)
    acts = tokens * layer_bytes_per_token(m, c, p.attention, T)
    weights = c * block_params(m)
    return flops, float(acts + weights), float(weights)


def _muon_flops(m: ModelConfig) -> float:
    """Muon's Newton-Schulz FLOPs for the whole model: per (r <= c) matrix, X Xt (2 r r c), A A
    (2 r^3) and B X (2 r r c), NS_STEPS times."""
    total = 0.0
    for rows, cols in hidden_matrices(m):
        r, c = min(rows, cols), max(rows, cols)
        total += NS_STEPS * (4.0 * r * r * c + 2.0 * r**3)
    return total


def _optimizer(m: ModelConfig, p: MemoryPlan, c: int, chip: _Chip) -> tuple[float, float, float]:
    """(seconds, FLOPs, collective bytes) of the optimizer update: HBM-bound over the chip's share
    of the fp32 weights, gradients and state (read, and written back); Muon's iterations, which
    a replicated TPU step runs whole on every chip and fsdp spreads over the chips, with the
    matrices gathered to their chip and the updates sent back."""
    P = param_count(m) / p.shards
    state = 8.0 * P  # AdamW's two moments (Muon's one moment on matrices: close enough)
    nbytes = 2.0 * (4.0 * P + state) + 4.0 * P  # weights and state read and written, grads read
    flops, moved = 0.0, 0.0
    if p.optimizer == "muon":
        matrices = sum(r * cols for r, cols in hidden_matrices(m))
        spread = p.world if p.layout == "fsdp" else 1
        flops = _muon_flops(m) / spread
        moved = 2.0 * c * matrices * _ring(p.shards) if p.layout == "fsdp" else 0.0
    return chip.run(flops, nbytes) + moved / chip.ingress, flops, moved


def step_time(m: ModelConfig, preset: Chip, p: MemoryPlan) -> StepTime | None:
    """The modelled step of ModelConfig `m` on `preset` in the configuration memory plan `p`
    describes (device batch x seq_len a chip, p.accum micro-batches, layout, remat, optimizer);
    None where the preset has no model (modelled()).

    Per micro-batch, each block runs its forward, then its backward (twice the forward's FLOPs,
    the weights and activations read again, the gradient written; remat: the forward again
    first), each phase at the slower of its FLOPs and its bytes; the head (6 V d a token, fp32
    logits) likewise. fsdp gathers each block's weights in the compute dtype before its forward
    and again before its backward, and reduce-scatters its gradient; all async, so a layer takes
    the slower of its compute and its collectives, and only the first layer's gather waits. The
    root (head, embedding, norms) is gathered and reduced once a micro-batch, in the open.
    Replicate all-reduces the fp32 gradient once a step after the last micro-batch, in the open;
    HSDP (fsdp_size < world) all-reduces its shard across replicas the same way. Then the
    optimizer update (_optimizer)."""
    if not modelled(preset):
        return None
    if m.vocab_size <= 0:  # as the memory plan counts it
        m = dataclasses.replace(m, vocab_size=TokenizerConfig().vocab_size)
    c = 2 if p.dtype == "bf16" else 4
    chip = _Chip(preset.peak_flops, preset.hbm_bandwidth, preset.ici_bandwidth / 2)
    tokens = p.device_batch * p.seq_len
    f_flops, f_bytes, weights = _layer(m, p, c)
    remat = p.remat == "block"
    fwd = chip.run(f_flops, f_bytes)
    bwd = chip.run(2 * f_flops, 2 * f_bytes) + (fwd if remat else 0.0)
    V = padded_vocab(m.vocab_size)
    head_flops = 6.0 * V * m.n_embd * tokens
    head = chip.run(head_flops, 2.0 * 12 * V * tokens + 3.0 * c * V * m.n_embd)
    ici = exposed = 0.0
    if p.layout == "fsdp":
        gather = weights * _ring(p.shards) / chip.ingress
        root = c * (param_count(m) - m.n_layer * block_params(m)) * _ring(p.shards)
        root_s = 2 * root / chip.ingress
        layers = m.n_layer * (max(fwd, gather) + max(bwd, 2 * gather)) + 2 * gather
        micro = layers + head + root_s
        ici = m.n_layer * 3 * gather + root_s
        exposed = micro - m.n_layer * (fwd + bwd) - head
    else:
        micro = m.n_layer * (fwd + bwd) + head
    after = 0.0
    replicas = p.world // p.shards
    if replicas > 1:  # replicate (shards 1) or HSDP: the gradient shard all-reduced in fp32
        after = 2 * _ring(replicas) * 4.0 * param_count(m) / p.shards / chip.ingress
    opt_s, opt_flops, opt_moved = _optimizer(m, p, c, chip)
    passes = 4 if remat else 3  # forward, backward twice its size, remat's forward again
    executed = p.accum * (m.n_layer * f_flops * passes + head_flops) + opt_flops
    return StepTime(
        step_s=p.accum * micro + after + opt_s,
        compute_s=executed / chip.peak,
        hbm_s=p.accum * m.n_layer * f_bytes * passes / chip.hbm,
        ici_s=p.accum * ici + after + opt_moved / chip.ingress,
        exposed_ici_s=p.accum * exposed + after + opt_moved / chip.ingress,
        model_flops=model_flops_per_token(m, p.seq_len) * tokens * p.accum,
        peak_flops=chip.peak,
    )
