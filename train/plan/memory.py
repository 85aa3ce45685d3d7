"""The memory plan: bytes per device to train a model on a hardware preset, in a layout, at a
device batch, so a setting that cannot fit is refused before training starts (exit 2 with the fix)
instead of dying minutes later, and so the presets' default device batches and the layout
(`choose_layout`) follow from memory instead of hand-written tables.

Per device, P = parameters, M = the blocks' matrices (Muon's), W = the world size (torchrun's
WORLD_SIZE; a preset's device count where no run is launched yet), F = devices sharing the state
(1 replicated; train.fsdp_size, 0 = all W, under fsdp), c = bytes of the compute dtype (2 bf16,
4 fp32), N = device_batch x seq_len tokens, accum = micro-batches per optimizer step
(train.batch_tokens / (N x W), decided by train/plan/batch.py and handed in as Setting.accum):

    weights          4 P / F     fp32 master weights
    gradients        4 P / F     fp32 (replicated: 4 P, whole for the whole step once accumulation
                                 has begun). fsdp on CPU/CUDA with accum > 1: 4 P, whole: FSDP2
                                 reduce-scatters only in the step's last backward
                                 (set_requires_gradient_sync, train/distributed/fsdp.py), and until
                                 then
                                 every block keeps its unsharded gradient, accumulated in fp32
    optimizer        8 P / F     AdamW's two fp32 moments; Muon: 4 bytes (one momentum) for the
                                 blocks' matrices, AdamW's 8 for the rest
    compute weights  replicate:  c x matmul weights under bf16 autocast (its cast cache keeps one
                                 bf16 copy of every weight from the forward until backward used it)
                     fsdp:       the gathered weights in c, plus one block's unsharded gradient
                                 (c + 4 for the fp32 reduce-scatter). ZeRO-2 (FSDP2's
                                 reshard_after_forward=False), chosen wherever its plan fits with
                                 headroom: c P, every block's weights kept from its forward to its
                                 backward. Else ZeRO-3: two blocks (the one computing and the
                                 next, prefetched) and the root's (embedding, head, final norm,
                                 which FSDP2 keeps gathered between forward and backward)
                     fsdp (TPU): ZeRO-3 over the stacked blocks (train/xla/step.py): each
                                 block's weights are gathered in c inside the layer loop, one
                                 block at a time (two: the one computing and the next), and its
                                 gradient (c + 4: the block's unsharded gradient and its fp32 copy)
                                 reduce-scattered into the sharded fp32 accumulators, so the
                                 gradients are 4 P / F for the whole step; the root R (embedding,
                                 head, final norm) is gathered whole in c once a step (hoisted out
                                 of the micro-batch While) and held through it, c R
    stacked blocks   fsdp (TPU):  8 B / F, B = the blocks' parameters (P less the root): the layer
                                 loop runs over a stacked fp32 copy of the block weights (sharded;
                                 stacked once a step before the micro-batch While and carried
                                 through it, 4 B / F) and the backward loop's stacked sharded fp32
                                 gradient of the micro-batch (4 B / F, alive from that loop's
                                 start until it is added into the accumulators), both read off
                                 the compiled HLO's loop carries (tests/test_xla_program.py). With
                                 AdamW a chip holds about 24 P / F of fp32 state and stacks, plus
                                 two gathered blocks and the root, whatever the accumulation
    activations      N x (n_layer x per_layer + head), per_layer from `layer_bytes_per_token`
                     (eager) or `compiled_layer_bytes_per_token` (torch.compile)
                     remat=block: N x (n_layer x c d + per_layer + head): the block inputs, and
                     one block's activations recomputed at a time
    logits           eager: 3 x 4 x padded vocab x N: fp32 logits, log-softmax, their gradient.
                     compiled: c x padded vocab x N: the head's output only (inductor fuses the
                     fp32 upcast and the cross-entropy into kernels that keep a max and a
                     log-sum-exp per token, and writes the logits' gradient over them)
    workspace        eager: N x per_layer: the gradients of the block in backward (as large as its
                     saved activations), the transient that sits on top of the forward's peak.
                     compiled: N x c x (the MLP's hidden activations + 2 d): the gradients of one
                     block's MLP and of the residual stream; the logits are freed before the
                     first block's backward, so the backward holds the larger of the two
    runtime          CUDA: the context and the libraries' kernels loaded into it (RUNTIME_CUDA),
                     and each NCCL communicator's buffers (NCCL_COMMUNICATOR; one over W > 1,
                     three under HSDP), none of which the caching allocator counts
    reduction        replicate over W > 1 on CPU/CUDA: the gradient reduction's flat buckets,
                     r P (r = 4, or 2 under train.reduce_dtype=bf16), filled during the last
                     backward and freed when all_reduce_grads has copied the sums back
    load buffers     at resume: the state arrives sharded (train/checkpoint/xla_shards.py,
                     DTensor targets on CUDA), so on top of the weights and optimizer state a
                     device holds one tensor's new shard while the old one is still alive, 4 x
                     the largest parameter / F. The host reads its chips' pieces of the state
                     (`host_load_bytes`), never a whole tensor it does not hold
    step buffers     what the optimizer step allocates (`muon_step_bytes`), after the
                     activations are freed and with the gradients reduced (4 P / F under fsdp):
                     Muon's updates (one process: 4 M; fsdp: the owner-rank exchange's
                     buffers, about c x 2 M / F, each owner orthogonalising one whole matrix at
                     a time; replicate over W: the all_gather of everyone's updates,
                     ~4 M x (2 + 3 / W); TPU replicated: every update, c M, and a whole group's
                     stack at work; TPU fsdp: this chip's rows of every update, c M / F, and
                     ceil(n / W) of a group's n matrices at work)

Which gradients the backward holds: with accumulation (accum > 1) every gradient from the
previous micro-batch (`gradients`); in a step's only micro-batch on CPU/CUDA none when it starts
(the loop frees them with zero_grad) and the output head's first (4 x padded vocab x d), each
later one made as the activations it needs are freed, so the step phase (which holds them all)
counts them. XLA's cached step carries them through its While either way (whole when replicated,
its shards under fsdp).

The peak is the largest of three phases: weights + optimizer state + runtime + max(held gradients
+ stacked blocks + compute weights + activations + logits + workspace (compiled: the larger of
logits and workspace), the reduced gradients + the larger of the reduction's buffers and the step
buffers, which are never alive together, the load buffers at resume).

Compiled or eager: train.compile runs torch.compile on CUDA only (train/distributed/backend.py:
make_backend); `setting_for` says which, and a Setting may say so for another kind (the CPU
measurements below). What inductor keeps for the backward was read off its forward graph's saved
outputs (the min-cut partition: every norm's output but not its fp32 intermediates, SwiGLU's
gate, up and product, QK-norm's input and RoPE's output, no fp32 copy of the logits); TPU runs
XLA, never torch.compile, and keeps the eager accounting.

The attention matters: SDPA's fused kernels (flash on CUDA, its CPU kernel, GQA included; checked
on torch 2.13) keep no [T, T] scores, only the output and a log-sum-exp per head; XLA's math
decomposition keeps the fp32 probabilities [n_head, T] per token and K/V copied to every query head.

Measured on the CPU (tests/test_memory_plan.py, bench/measure_step_memory.py), one process,
forward + backward + AdamW step in a fresh process. Eager, fp32: peak RSS (VmHWM) minus the
resident size before the model was built: the estimate is within 25% of the peak. Compiled
(inductor), fp32 and bf16: the second step's rise in resident size plus the weights and AdamW's
state: within 15%, at three model sizes; on an H200 (torch.cuda.max_memory_allocated) within 5%
of compiled runs of 124m and 1b (the tables are in docs/hardware.md). On 2 gloo
ranks with Muon (fsdp, accumulation 4; replicate, accumulation 2), bytes counted as the step runs
(bench/count_step_memory.py, a model whose state is most of the peak): the weights + optimizer
state, the gradients between micro-batches and at the step, the step buffers and the total are each
within 15% (within 8% when measured). With more tokens the counted peak falls below the plan (by
up to ~40% at 512 tokens under fsdp): the eager activation terms are sized by peak RSS (what runs
out), which is above the bytes the tensors hold.
A setting fits when the total is at most HEADROOM of the device's memory: the rest is for the
caching allocator's blocks reserved but free at the peak (few with expandable segments, which the
CUDA backend turns on: train/distributed/backend.py), the XLA runtime, and the plan's own error.

Inputs: the ModelConfig, the Device (a hardware preset), the device batch and sequence length, and
a `Setting` (everything else, typed: train.* resolved for one backend kind by `setting_for`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass
from typing import Literal, Protocol

from codex.core.config import ConfigError
from codex.core.config.model import (
    ModelConfig,
    has_value_embed,
    matmul_params,
    mlp_hidden,
    padded_vocab,
)
from codex.core.config.train import TrainConfig
from codex.train.plan.batch import micro_batches
from codex.train.plan.owners import balanced_owners, wide

HEADROOM = 0.9  # a plan fits when its total is at most this share of the device's memory
# `codex hardware` and the preset defaults, for a model whose vocab is not known yet
DEFAULT_VOCAB = 32768
LAYOUTS = ("replicate", "fsdp")
# What a CUDA process holds outside the caching allocator, which torch.cuda.max_memory_allocated
# never shows: the context (a few hundred MB with lazy module loading) and the kernels of cuBLAS,
# cuDNN and the compiled step loaded into it
RUNTIME_CUDA = 750_000_000
# one NCCL communicator's buffers and proxy state on each GPU: NCCL sizes them per channel and
# peer, about half a GB per group on NVLink machines
NCCL_COMMUNICATOR = 600_000_000

Dtype = Literal["bf16", "fp32"]
LayoutName = Literal["replicate", "fsdp"]


class Device(Protocol):
    """What the plan reads of a hardware preset (train/plan/hardware.py: HardwarePreset)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...  # "cpu", "cuda" or "tpu"
    @property
    def hosts(self) -> int: ...
    @property
    def devices(self) -> int: ...
    @property
    def memory_gb(self) -> float: ...  # per device; 0 = unknown (the CPU's: the machine's RAM)


def compiled_on(kind: str, enabled: bool = True) -> bool:
    """Whether a run on a backend of `kind` (cpu, cuda, tpu) runs torch.compile under
    train.compile=`enabled`: on CUDA only, as train/distributed/backend.py's make_backend decides
    (the CPU runs eager; TPU traces its own XLA graph)."""
    return enabled and kind == "cuda"


def compute_dtype(dtype: str, kind: str) -> Dtype:
    """The compute dtype train.dtype means on a backend of `kind` (cpu, cuda, tpu): auto = bf16 on
    accelerators, fp32 on the CPU. The one place auto is decided: the memory plan counts it and the
    backends autocast to it (train/distributed/backend.py: resolve_dtype)."""
    if dtype == "auto":
        return "fp32" if kind == "cpu" else "bf16"
    if dtype == "bf16":
        return "bf16"
    if dtype == "fp32":
        return "fp32"
    raise ValueError(f"train.dtype must be auto, bf16 or fp32, got {dtype!r}")


@dataclass(frozen=True)
class Setting:
    """Everything the memory plan reads besides the model, the device and the batch. Made from the
    config by `setting_for`, or written out for a what-if (`codex hardware`, the default batches,
    the fixes a refusal offers)."""

    dtype: Dtype = "bf16"  # compute dtype (train.dtype, auto resolved by compute_dtype)
    optimizer: Literal["adamw", "muon"] = "adamw"
    # train.parallel; plan() takes replicate or fsdp (choose_layout resolves auto)
    layout: Literal["auto", "replicate", "fsdp"] = "replicate"
    fsdp_size: int = 0  # fsdp: devices one copy of the state is sharded over; 0 = all
    remat: Literal["none", "block"] = "none"
    world: int = 0  # data-parallel ranks (torchrun's WORLD_SIZE); 0 = the preset's devices
    accum: int = 1  # micro-batches per optimizer step (train/plan/batch.py decides it)
    reduce_dtype: Dtype = "fp32"  # train.reduce_dtype: the gradient reduction's buffers
    # the step under torch.compile: None = as train.compile's default runs on the preset's kind
    # (compiled_on: CUDA compiled, the CPU eager); TPU is never compiled (XLA's own graph)
    compiled: bool | None = None
    # bytes per device to judge the plan against: None = the preset's; check_fits passes this
    # machine's (the GPU's real size, the CPU's free RAM)
    device_memory: int | None = None

    def __post_init__(self) -> None:
        # a value outside its Literal (train.dtype=auto unresolved, a typo) would be counted as
        # some other setting without a word
        for name, allowed in _choices().items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"Setting.{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        if self.accum < 1:
            raise ValueError(f"Setting.accum must be at least 1, got {self.accum}")

    def ranks(self, preset: Device) -> int:
        """The data-parallel ranks this setting plans for: world, else the preset's devices."""
        return self.world if self.world > 0 else max(1, preset.devices)


@functools.cache
def _choices() -> dict[str, tuple[str, ...]]:
    """Setting's fields typed Literal[...]: {name: the values it takes}."""
    hints = typing.get_type_hints(Setting)
    return {
        name: typing.get_args(hint)
        for name, hint in hints.items()
        if typing.get_origin(hint) is Literal
    }


DEFAULT_SETTING = Setting()  # bf16, AdamW, replicated, compiled as on the kind: the default batches


def setting_for(tcfg: TrainConfig, kind: str, world: int = 0) -> Setting:
    """The plan's Setting for train.* on a backend of `kind` with `world` data-parallel ranks (the
    run's world size; 0 = the preset's devices): the one place that reads the config.
    train.parallel (auto | replicate | fsdp) and train.fsdp_size map onto layout and fsdp_size
    (auto is resolved by choose_layout), train.dtype onto the compute dtype (compute_dtype),
    train.compile onto whether the step runs compiled (compiled_on). The accumulation is the
    batch's (train/plan/batch.py), set once the device batch is known."""
    return Setting(
        dtype=compute_dtype(tcfg.dtype, kind),
        optimizer=tcfg.optimizer,
        layout=tcfg.parallel,
        fsdp_size=tcfg.fsdp_size,
        remat=tcfg.remat,
        world=world,
        reduce_dtype=tcfg.reduce_dtype,
        compiled=compiled_on(kind, tcfg.compile),
    )


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device for one setting; `lines()` is the readable breakdown."""

    hardware: str
    layout: LayoutName
    shards: int  # devices the weights, gradients and optimizer state are divided over
    device_batch: int
    seq_len: int
    dtype: Dtype  # compute dtype
    remat: Literal["none", "block"]
    attention: str  # fused | math | flash (attention_for)
    optimizer: Literal["adamw", "muon"]
    params: int
    weights: int
    gradients: int  # during the micro-batches (whole under fsdp with accumulation on CPU/CUDA)
    optimizer_state: int
    compute_weights: int
    activations: int
    logits: int
    workspace: int
    device_memory: int  # bytes per device (0 = unknown)
    world: int = 1  # data-parallel ranks (torchrun's WORLD_SIZE, or the preset's devices)
    accum: int = 1  # micro-batches per optimizer step
    step_gradients: int = 0  # at the optimizer step: reduced (4 P / F under fsdp)
    step_buffers: int = 0  # what the optimizer step allocates (Muon's updates)
    # replicate over W > 1 (CPU/CUDA): the reduction's flat buckets, filled during the last
    # backward and freed by all_reduce_grads (train/distributed/reduce.py), before the optimizer
    # step
    reduce_buffers: int = 0
    # fsdp: False = ZeRO-2, the gathered weights held from forward to backward (what
    # compute_weights counts; TPU: always); train/plan/plan.py passes it on in the LayoutName
    reshard_after_forward: bool = True
    compiled: bool = False  # the step under torch.compile (activations, logits, workspace)
    # gradients alive when a micro-batch's backward starts: `gradients` with accumulation (and on
    # TPU); otherwise only the output head's, the first the backward makes
    held_gradients: int = 0
    runtime: int = 0  # CUDA: the context and NCCL's buffers, outside the caching allocator
    # at resume, on top of the state (which arrives sharded): one tensor's shard made while the
    # old one is alive
    load_buffers: int = 0
    # TPU fsdp: the layer loop's stacked block weights (fp32, sharded; made once a step before the
    # micro-batch While and carried through it) and the backward loop's stacked sharded gradient
    # of one micro-batch before it is added into the accumulators
    stacked: int = 0

    @property
    def backward(self) -> int:
        """Bytes on top of the weights and optimizer state during forward and backward. Compiled,
        the logits are freed before the first block's backward allocates its workspace."""
        transient = (
            max(self.logits, self.workspace) if self.compiled else self.logits + self.workspace
        )
        held = self.held_gradients + self.stacked + self.compute_weights
        return held + self.activations + transient

    @property
    def step(self) -> int:
        """Bytes on top of the weights and optimizer state from the end of the backward (the
        reduction's buffers) through the optimizer step (its own buffers), which come one after
        the other."""
        return self.step_gradients + max(self.reduce_buffers, self.step_buffers)

    @property
    def total(self) -> int:
        phases = max(self.backward, self.step, self.load_buffers)
        return self.weights + self.optimizer_state + self.runtime + phases

    def host_load_bytes(self, devices_per_host: int) -> int:
        """Host memory the resume path reads the checkpoint into: the pieces of the weights and
        the optimizer state this host's chips hold, each distinct shard once (HSDP replicas on one
        host share theirs), before they go to the chips."""
        distinct = min(devices_per_host, self.shards) if self.layout == "fsdp" else 1
        return distinct * (self.weights + self.optimizer_state)

    def fits(self, headroom: float = HEADROOM) -> bool:
        return self.device_memory <= 0 or self.total <= headroom * self.device_memory

    def lines(self) -> list[str]:
        unit, scale = ("GB", 1e9) if self.total >= 1e9 else ("MB", 1e6)
        gb = lambda n: f"{n / scale:8.2f} {unit}"  # noqa: E731
        layout = "replicate" if self.layout == "replicate" else f"fsdp over {self.shards} devices"
        if self.layout == "fsdp" and self.world > self.shards:
            layout += f" x {self.world // self.shards} replicas (HSDP)"
        elif self.layout == "replicate" and self.world > 1:
            layout += f" over {self.world} devices"
        mem = f"{self.device_memory / 1e9:.1f} GB" if self.device_memory > 0 else "unknown"
        whole = self.layout == "fsdp" and self.gradients > self.step_gradients
        parts = [
            ("weights (fp32)", self.weights),
            ("gradients (fp32, whole)" if whole else "gradients (fp32)", self.gradients),
            (f"optimizer ({self.optimizer})", self.optimizer_state),
            (
                f"gathered weights, ZeRO-{3 if self.reshard_after_forward else 2}"
                if self.layout == "fsdp"
                else f"weights in {self.dtype}",
                self.compute_weights,
            ),
            ("stacked blocks (fp32, sharded)", self.stacked),
            (
                f"activations ({'compiled' if self.compiled else 'eager'}"
                f"{', remat' if self.remat == 'block' else ''})",
                self.activations,
            ),
            (f"logits ({self.dtype if self.compiled else 'fp32'})", self.logits),
            ("workspace", self.workspace),
            ("gradient reduction", self.reduce_buffers),
            ("optimizer step buffers", self.step_buffers),
            ("CUDA context, NCCL", self.runtime),
        ]
        accum = f", accum {self.accum}" if self.accum > 1 else ""
        head = (
            f"memory plan: {self.params / 1e6:.1f}M params on {self.hardware} ({mem} per device), "
            f"{layout}, device batch {self.device_batch} x {self.seq_len}{accum}, {self.dtype}, "
            f"{self.attention} attention"
        )
        peak = " (at the optimizer step)" if self.step > self.backward else ""
        if self.load_buffers > max(self.step, self.backward):
            peak = " (at resume)"
        share = (
            f" ({self.total / self.device_memory:.0%} of the device)"
            if self.device_memory > 0
            else ""
        )
        return (
            [head]
            + [f"  {name:<30}{gb(n)}" for name, n in parts if n]
            + [f"  {'total':<30}{gb(self.total)}{share}{peak}"]
        )


# --- parameter counts ---------------------------------------------------------------------------


def param_count(m: ModelConfig) -> int:
    """Parameters of model.gpt.GPT for ModelConfig `m`: the matmul weights (output head over the
    padded vocab included), the embedding table when it is not tied to the head, and the value
    embeddings (model.value_embed: a padded vocab x K/V width table on every other layer)."""
    kv_width = m.n_kv_head * (m.n_embd // m.n_head)
    value_tables = sum(has_value_embed(m, i) for i in range(m.n_layer))
    embeddings = (0 if m.tie_embeddings else m.n_embd) + value_tables * kv_width
    return matmul_params(m) + padded_vocab(m.vocab_size) * embeddings


def largest_param(m: ModelConfig) -> int:
    """The entries of the model's largest parameter: the output head (padded vocab x d), or an
    MLP matrix when it is larger."""
    return max(padded_vocab(m.vocab_size) * m.n_embd, mlp_hidden(m) * m.n_embd)


def block_params(m: ModelConfig) -> int:
    """One transformer block's parameters (model.gpt.Block)."""
    return (matmul_params(m) - m.n_embd - m.n_embd * padded_vocab(m.vocab_size)) // m.n_layer


def hidden_matrices(m: ModelConfig) -> list[tuple[int, int]]:
    """(rows, cols) of every matrix Muon updates (train.optim.muon.is_hidden_matrix: the blocks'
    2-D weights, everything in a block but its norms), in the optimizer's order: model/gpt.py's
    c_q, c_k, c_v, c_proj, w_gate (swiglu), w_up, w_down, block after block."""
    d, hd, h = m.n_embd, m.n_embd // m.n_head, mlp_hidden(m)
    q, kv = m.n_head * hd, m.n_kv_head * hd
    block = [(q, d), (kv, d), (kv, d), (d, q)]
    block += [(h, d)] * (2 if m.mlp == "swiglu" else 1) + [(d, h)]
    return block * m.n_layer


def _muon_params(m: ModelConfig) -> int:
    """M: the entries of Muon's matrices."""
    return sum(r * c for r, c in hidden_matrices(m))


def optimizer_bytes(m: ModelConfig, optimizer: str) -> int:
    """Optimizer state for the whole model: AdamW keeps two fp32 moments per parameter; Muon one
    fp32 momentum per hidden matrix entry, and AdamW's two for everything else."""
    if optimizer == "muon":
        return 4 * _muon_params(m) + 8 * (param_count(m) - _muon_params(m))
    return 8 * param_count(m)


def muon_step_bytes(m: ModelConfig, kind: str, layout: str, F: int, W: int, c: int) -> int:
    """What Muon's step allocates on top of the state, per device (train/optim/muon.py; counted
    on the CPU by bench/count_step_memory.py). Muon iterates in the compute dtype (c bytes), one
    stack per shape group on each matrix's owner rank (owners.py: balanced_owners); M = the
    matrices' entries, F the ranks sharing the state, W the world:

        one process, TPU  every matrix's update until they are applied (c M), plus one group's
        (replicated)      stack at work (_stack_work; TPU: XLA's one graph, assumed)
        fsdp (TPU)        each group's stack split over the W chips (train/xla/update.py), each
                          iterating ceil(n / W) of its n matrices, the results sent to row shards
                          (an all-to-all), never gathered whole: this chip's rows of every update
                          (c M / F) and the largest group's share at work
        replicate, W > 1  the all_gather of the updates in the iteration's dtype, w = the busiest
                          rank's share: its own updates, the send buffer and their flat copy
                          (3 c w), the W received (c W w) and the collective's flat output they
                          are copied out of (c W w)
        fsdp (CPU/CUDA)   the owner-rank exchange (muon.py: _owner_updates), s = this rank's
                          row shards of every matrix (M / F), o = the entries an owner iterates:
                          the largest of its three phases, the first all_to_all (send + receive,
                          c (s + o)), iterating (the receive buffer and its largest group's stack
                          at work, c o + work), the second all_to_all's output and, in bf16, its
                          fp32 copy (c s, + 4 s)

    AdamW's step is not counted (fused on CUDA; on the CPU a few copies of one parameter at a
    time)."""
    shapes = [wide(shape) for shape in hidden_matrices(m)]
    sizes = [r * cols for r, cols in shapes]
    if not sizes:
        return 0
    if kind == "tpu" and layout == "fsdp" and W > 1:
        groups: dict[tuple[int, int], int] = {}
        for shape in shapes:
            groups[shape] = groups.get(shape, 0) + 1
        share = [shape for shape, n in groups.items() for _ in range(-(-n // W))]
        return c * -(-sum(sizes) // F) + _stack_work(share, [0] * len(share), c)[0]
    if kind == "tpu" or W == 1:
        return c * sum(sizes) + _stack_work(shapes, [0] * len(shapes), c)[0]
    if layout == "fsdp":
        s = -(-sum(sizes) // F)
        owner = balanced_owners(sizes, F)
        o = [sum(n for n, q in zip(sizes, owner, strict=True) if q == rank) for rank in range(F)]
        work = _stack_work(shapes, owner, c)
        iterate = max(c * o[rank] + work[rank] for rank in range(F))
        return max(c * (s + max(o)), iterate, (c + (4 if c != 4 else 0)) * s)
    owner = balanced_owners(sizes, W)
    width = max(sum(n for n, q in zip(sizes, owner, strict=True) if q == r) for r in range(W))
    return c * (2 * W + 3) * width


def _stack_work(shapes: list[tuple[int, int]], owner: list[int], c: int) -> list[int]:
    """Per rank, the most one shape group's Newton-Schulz holds at once: its k (rows, cols)
    matrices stacked, the stack and one more taking turns with each step's result, and the two
    (rows, rows) products, c bytes an entry: c k rows (2 cols + 2 rows)."""
    work = [0] * (max(owner) + 1)
    for rank in range(len(work)):
        k: dict[tuple[int, int], int] = {}
        for shape, q in zip(shapes, owner, strict=True):
            if q == rank:
                k[shape] = k.get(shape, 0) + 1
        work[rank] = max((c * n * r * (2 * cols + 2 * r) for (r, cols), n in k.items()), default=0)
    return work


# --- activations ----------------------------------------------------------------------------------


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


# --- the plan -------------------------------------------------------------------------------------


def shards_for(layout: str, fsdp_size: int, devices: int) -> int:
    """Devices the state is divided over: 1 replicated; fsdp_size (0 = all `devices`: the world
    size) under fsdp."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "replicate" else (fsdp_size if fsdp_size > 0 else max(1, devices))


def attention_for(kind: str, model_attention: str = "sdpa") -> str:
    """The attention implementation a backend of `kind` runs: XLA lowers SDPA to its math form
    (the T x T probabilities in memory) unless model.attention=flash runs the Pallas kernel,
    which, like CUDA's fused SDPA, never holds them, but needs K/V repeated to every query head
    under GQA (train/xla/flash.py: expand_kv_heads), a copy the plan counts."""
    if kind == "tpu":
        # auto runs flash on a TPU (or blockwise where Pallas cannot: no T x T either); only
        # sdpa is XLA's math path
        return "math" if model_attention == "sdpa" else "flash"
    return "fused"


def plan(
    m: ModelConfig,
    preset: Device,
    device_batch: int,
    seq_len: int,
    setting: Setting = DEFAULT_SETTING,
) -> MemoryPlan:
    """The memory plan for ModelConfig `m` (vocab_size set; 0 counts DEFAULT_VOCAB) on `preset`
    at device_batch x seq_len, in `setting` (its layout replicate or fsdp: choose_layout resolves
    auto first). Long because every term is a line of the module docstring's arithmetic, kept
    side by side in one place."""
    if m.vocab_size <= 0:
        m = dataclasses.replace(m, vocab_size=DEFAULT_VOCAB)
    c = 2 if setting.dtype == "bf16" else 4
    attention = attention_for(preset.kind, m.attention)
    world = setting.ranks(preset)
    layout: LayoutName
    if world == 1:
        layout = "replicate"  # one process is always replicated (train/plan/layout.py)
    elif setting.layout == "auto":
        raise ValueError("plan() takes layout replicate or fsdp: choose_layout resolves auto")
    else:
        layout = setting.layout
    shards = shards_for(layout, setting.fsdp_size, world)
    P = param_count(m)
    tokens = device_batch * seq_len
    tpu = preset.kind == "tpu"
    compiled = not tpu and (
        compiled_on(preset.kind) if setting.compiled is None else setting.compiled
    )
    V = padded_vocab(m.vocab_size)
    if compiled:
        per_layer = compiled_layer_bytes_per_token(m, c)
        head = compiled_head_bytes_per_token(m, c)
        # the head's output; its max and log-sum-exp per token in fp32
        logits = (c * V + 8) * tokens
        workspace = compiled_workspace_per_token(m, c) * tokens
    else:
        per_layer = layer_bytes_per_token(m, c, attention, seq_len)
        head = head_bytes_per_token(m, c)
        logits = 3 * 4 * V * tokens
        workspace = per_layer * tokens
    kept_layers = (
        m.n_layer * per_layer if setting.remat == "none" else m.n_layer * c * m.n_embd + per_layer
    )
    if layout == "fsdp":
        # ZeRO-3: two blocks gathered (the one computing and the next), the root whole, and one
        # block's unsharded gradient before its reduce-scatter (on TPU the scanned layer loop,
        # train/xla/step.py; on CPU/CUDA FSDP2, which may keep more: ZeRO-2 below)
        root = P - m.n_layer * block_params(m)
        compute_weights = c * (2 * block_params(m) + root) + (c + 4) * block_params(m)
    else:
        compute_weights = c * matmul_params(m) if c < 4 else 0
    at_preset = int(preset.memory_gb * 1e9)
    reduced = -(-4 * P // shards)
    # FSDP2 without gradient sync keeps every block's unsharded gradient until the last backward
    # (accumulated in its reduce_dtype); XLA's layer loop reduce-scatters each block's gradient
    # into the sharded fp32 accumulators at once
    r = 2 if setting.reduce_dtype == "bf16" else 4
    held = r * P if layout == "fsdp" and not tpu and setting.accum > 1 else reduced
    # NCCL communicators: the world's; under HSDP also the shard and the replica groups'
    communicators = (3 if layout == "fsdp" and world > shards else 1) if world > 1 else 0
    p = MemoryPlan(
        hardware=preset.name,
        layout=layout,
        shards=shards,
        device_batch=device_batch,
        seq_len=seq_len,
        dtype=setting.dtype,
        remat=setting.remat,
        attention=attention,
        optimizer=setting.optimizer,
        params=P,
        weights=-(-4 * P // shards),
        gradients=held,
        optimizer_state=-(-optimizer_bytes(m, setting.optimizer) // shards),
        compute_weights=compute_weights,
        activations=tokens * (kept_layers + head),
        logits=logits,
        workspace=workspace,
        device_memory=at_preset if setting.device_memory is None else setting.device_memory,
        world=world,
        accum=setting.accum,
        step_gradients=reduced,
        step_buffers=(
            muon_step_bytes(m, preset.kind, layout, shards, world, c)
            if setting.optimizer == "muon"
            else 0
        ),
        # the replicated reduction's flat buckets (train/distributed/reduce.py), in
        # train.reduce_dtype
        reduce_buffers=r * P if layout == "replicate" and world > 1 and not tpu else 0,
        reshard_after_forward=True,
        compiled=compiled,
        # a step's only micro-batch starts its backward with no gradient (zero_grad freed them);
        # the output head's comes first, made while the logits are still held
        held_gradients=held if tpu or setting.accum > 1 else 4 * V * m.n_embd,
        runtime=(RUNTIME_CUDA + communicators * NCCL_COMMUNICATOR if preset.kind == "cuda" else 0),
        load_buffers=-(-4 * largest_param(m) // shards),
        # ZeRO-3's layer loop (train/xla/step.py: scanned_blocks): the stacked block weights and
        # the stacked gradient of a micro-batch, both fp32 and sharded like the weights
        stacked=2 * -(-4 * m.n_layer * block_params(m) // shards)
        if tpu and layout == "fsdp"
        else 0,
    )
    if layout == "fsdp" and not tpu:
        # FSDP2 (CPU/CUDA): keep the gathered weights from forward to backward (one all-gather per
        # block a micro-batch instead of two) when that fits with headroom: at the end of the
        # forward every block is gathered, each freed by its backward
        kept = c * P + (c + 4) * block_params(m)
        zero2 = dataclasses.replace(p, compute_weights=kept, reshard_after_forward=False)
        # judged at the preset's memory, never this process's measured free memory: every rank
        # must make the same choice (ZeRO-2 and ZeRO-3 run different collectives in the backward)
        return zero2 if dataclasses.replace(zero2, device_memory=at_preset).fits() else p
    return p


def at_batch(
    setting: Setting, preset: Device, batch_tokens: int, device_batch: int, seq_len: int
) -> Setting:
    """`setting` with the accumulation train.batch_tokens implies at device_batch x seq_len
    (train/plan/batch.py: micro_batches), for the searches that plan batches before one is
    chosen."""
    accum = micro_batches(batch_tokens, device_batch, seq_len, setting.ranks(preset))
    return dataclasses.replace(setting, accum=accum)


def largest_batch(
    m: ModelConfig,
    preset: Device,
    seq_len: int,
    cap: int,
    setting: Setting = DEFAULT_SETTING,
    batch_tokens: int = 0,
) -> int:
    """The largest power of two <= cap whose plan fits with headroom; 0 when not even 1 does.
    Each candidate accumulates as train.batch_tokens implies there (0: one micro-batch)."""
    b = 1 << max(0, cap.bit_length() - 1)
    while b >= 1:
        if plan(m, preset, b, seq_len, at_batch(setting, preset, batch_tokens, b, seq_len)).fits():
            return b
        b //= 2
    return 0


def fsdp_offered(preset: Device, world: int = 0) -> bool:
    """Whether auto and `codex hardware` consider fsdp on this preset: over several devices
    (`world` ranks; 0 = the preset's devices), multi-host TPU slices included (each host writes
    and reads its own shards, train/checkpoint/xla_shards.py); fsdp over one device is the
    replicated layout."""
    return (world if world > 0 else preset.devices) > 1


def choose_layout(
    m: ModelConfig,
    preset: Device,
    device_batch: int,
    seq_len: int,
    setting: Setting = DEFAULT_SETTING,
) -> LayoutName:
    """train.parallel=auto: replicate when the replicated plan fits with headroom (no gathers, the
    fastest layout), else fsdp (over setting.fsdp_size devices; 0 = all) where the preset runs
    it."""
    replicated = dataclasses.replace(setting, layout="replicate")
    fits = plan(m, preset, device_batch, seq_len, replicated).fits()
    return "replicate" if fits or not fsdp_offered(preset, setting.world) else "fsdp"


# --- the refusal ----------------------------------------------------------------------------------


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
        return (
            int(info["MemAvailable"]) * 1024 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        )
    except (OSError, KeyError, ValueError):
        return None


def _train_key_exists(name: str) -> bool:
    """Whether train.<name> is a setting, so a fix never names a key the config would reject."""
    return name in {f.name for f in dataclasses.fields(TrainConfig)}


def fixes(
    m: ModelConfig, preset: Device, p: MemoryPlan, setting: Setting, batch_tokens: int = 0
) -> list[str]:
    """The settings that would make `p` (planned in `setting`) fit with headroom, each checked
    against the plan: a smaller device batch (same layout; train.batch_tokens accumulates the
    rest), the fsdp layout, block rematerialisation."""
    same = dataclasses.replace(setting, layout=p.layout, device_memory=p.device_memory)
    out = []
    b = (
        largest_batch(m, preset, p.seq_len, p.device_batch - 1, same, batch_tokens)
        if p.device_batch > 1
        else 0
    )
    if b:
        out.append(
            f"train.device_batch={b} (keep --batch-tokens: gradient accumulation makes up the rest)"
        )
    changes: tuple[tuple[str, Setting], ...] = (
        ("parallel", dataclasses.replace(same, layout="fsdp")),
        ("remat", dataclasses.replace(same, remat="block")),
    )
    for key, other in changes:
        value = other.layout if key == "parallel" else other.remat
        if _train_key_exists(key) and other != same:
            q = plan(m, preset, p.device_batch, p.seq_len, other)
            if q.fits():
                out.append(f"train.{key}={value} ({q.total / 1e9:.1f} GB)")
    return out


def check_fits(
    m: ModelConfig,
    preset: Device,
    device_batch: int,
    seq_len: int,
    setting: Setting = DEFAULT_SETTING,
    batch_tokens: int = 0,
) -> MemoryPlan:
    """The plan for this setting on this machine (the GPU's real memory, the CPU's free RAM), or a
    ConfigError (exit 2) with the breakdown and the fixes when its total exceeds the device.
    batch_tokens: train.batch_tokens, for the smaller device batches a fix may offer."""
    avail = available_bytes(preset.kind, preset.memory_gb)
    here = dataclasses.replace(setting, device_memory=avail or 0)
    p = plan(m, preset, device_batch, seq_len, here)
    if avail is None or p.fits(1.0):
        return p
    where = "available on this machine" if preset.kind == "cpu" else "per device"
    found = fixes(m, preset, p, here, batch_tokens)
    fix = (
        "; ".join(found)
        if found
        else "a smaller model, hardware with more memory or a shorter train.seq_len"
    )
    raise ConfigError(
        f"train.device_batch={device_batch} x train.seq_len={seq_len} needs "
        f"{p.total / 1e9:.1f} GB per device "
        f"(weights {p.weights / 1e9:.1f}, gradients {p.gradients / 1e9:.1f}, "
        f"optimizer {p.optimizer_state / 1e9:.1f}, "
        f"activations {p.activations / 1e9:.1f}, logits {p.logits / 1e9:.1f}, "
        "compute copies of the weights and "
        f"workspace {(p.compute_weights + p.stacked + p.workspace) / 1e9:.1f}"
        + (f", CUDA context and NCCL {p.runtime / 1e9:.1f}" if p.runtime else "")
        + (
            f"; at the optimizer step, its buffers {p.step_buffers / 1e9:.1f}"
            if p.step_buffers
            else ""
        )
        + ") "
        f"but {avail / 1e9:.1f} GB is {where}. Fix: {fix}"
    )


def default_batch(
    m: ModelConfig,
    preset: Device,
    seq_len: int,
    cap: int,
    setting: Setting = DEFAULT_SETTING,
    batch_tokens: int = 0,
) -> tuple[int, LayoutName]:
    """(device batch, layout) a preset suggests: the largest power of two <= cap that fits with
    headroom (largest_batch), in setting.layout; under auto replicated when any batch fits
    replicated, else under fsdp. The batch is 0 when nothing fits."""
    if setting.layout != "auto":
        return largest_batch(m, preset, seq_len, cap, setting, batch_tokens), setting.layout
    replicated = dataclasses.replace(setting, layout="replicate")
    b = largest_batch(m, preset, seq_len, cap, replicated, batch_tokens)
    if b or not fsdp_offered(preset, setting.world):
        return b, "replicate"
    sharded = dataclasses.replace(setting, layout="fsdp")
    return largest_batch(m, preset, seq_len, cap, sharded, batch_tokens), "fsdp"
