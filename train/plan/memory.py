"""The memory plan: bytes per device to train a model on a hardware preset, in a layout, at a
device batch. `plan` sums one small function per term (docs/hardware.md, "The arithmetic, term by
term", gives each term's formula and how it was measured); `Setting` is everything it reads besides
the model, the device and the batch. The searches and the refusal built on it are in batch.py."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Literal, Protocol

from codex.core.config.data import TokenizerConfig
from codex.core.config.model import ModelConfig, matmul_params, padded_vocab
from codex.core.config.train import TrainConfig
from codex.train.plan.activations import (
    compiled_head_bytes_per_token,
    compiled_layer_bytes_per_token,
    compiled_workspace_per_token,
    head_bytes_per_token,
    layer_bytes_per_token,
)
from codex.train.plan.params import (
    block_params,
    largest_param,
    muon_step_bytes,
    optimizer_bytes,
    param_count,
)

HEADROOM = 0.9  # a plan fits when its total is at most this share of the device's memory
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
    """What the plan reads of a hardware preset (train/plan/presets.py: HardwarePreset)."""

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
        remat="none" if tcfg.remat == "auto" else tcfg.remat,  # auto: batch.py decides
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


# --- the terms --------------------------------------------------------------------------------


def shards_for(layout: str, fsdp_size: int, devices: int) -> int:
    """Devices the state is divided over: 1 replicated; fsdp_size (0 = all `devices`: the world
    size) under fsdp."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "replicate" else (fsdp_size if fsdp_size > 0 else max(1, devices))


def attention_for(kind: str, model_attention: str = "sdpa") -> str:
    """The attention a backend of `kind` runs: on TPU XLA's math form of SDPA (the T x T
    probabilities in memory) for model.attention=sdpa, else flash (or blockwise where Pallas
    cannot run: no T x T either); CUDA and the CPU run SDPA's fused kernels."""
    if kind == "tpu":
        return "math" if model_attention == "sdpa" else "flash"
    return "fused"


@dataclass(frozen=True)
class Where:
    """The setting resolved on one device: what every term reads besides the model."""

    kind: str  # cpu, cuda or tpu
    layout: LayoutName
    shards: int  # devices the state is divided over
    world: int  # data-parallel ranks
    c: int  # bytes of the compute dtype
    compiled: bool  # the step under torch.compile
    attention: str  # fused | math | flash
    setting: Setting

    @property
    def tpu(self) -> bool:
        return self.kind == "tpu"


def resolve(m: ModelConfig, preset: Device, setting: Setting) -> Where:
    """`setting` on `preset` for model `m`: the layout (one process is always replicated), the
    shards, the compute dtype's bytes, whether the step is compiled (never on TPU), the
    attention."""
    world = setting.ranks(preset)
    layout: LayoutName
    if world == 1:
        layout = "replicate"
    elif setting.layout == "auto":
        raise ValueError("plan() takes layout replicate or fsdp: choose_layout resolves auto")
    else:
        layout = setting.layout
    compiled = preset.kind != "tpu" and (
        compiled_on(preset.kind) if setting.compiled is None else setting.compiled
    )
    return Where(
        kind=preset.kind,
        layout=layout,
        shards=shards_for(layout, setting.fsdp_size, world),
        world=world,
        c=2 if setting.dtype == "bf16" else 4,
        compiled=compiled,
        attention=attention_for(preset.kind, m.attention),
        setting=setting,
    )


def activation_bytes(m: ModelConfig, w: Where, seq_len: int, tokens: int) -> tuple[int, int, int]:
    """(activations, logits, workspace) of a micro-batch of `tokens` tokens."""
    V = padded_vocab(m.vocab_size)
    if w.compiled:
        per_layer = compiled_layer_bytes_per_token(m, w.c)
        head = compiled_head_bytes_per_token(m, w.c)
        logits = (w.c * V + 8) * tokens  # the head's output; a max and log-sum-exp per token
        workspace = compiled_workspace_per_token(m, w.c) * tokens
    else:
        per_layer = layer_bytes_per_token(m, w.c, w.attention, seq_len)
        head = head_bytes_per_token(m, w.c)
        logits = 3 * 4 * V * tokens
        workspace = per_layer * tokens
    if w.setting.remat == "none":
        kept = m.n_layer * per_layer
    else:  # the block inputs, and one block's activations recomputed at a time
        kept = m.n_layer * w.c * m.n_embd + per_layer
    return tokens * (kept + head), logits, workspace


def compute_weight_bytes(m: ModelConfig, w: Where) -> int:
    """Replicated: autocast's copy of the matmul weights. fsdp, ZeRO-3: two blocks gathered (the
    one computing and the next), the root whole, and one block's unsharded gradient before its
    reduce-scatter."""
    if w.layout == "fsdp":
        root = param_count(m) - m.n_layer * block_params(m)
        return w.c * (2 * block_params(m) + root) + (w.c + 4) * block_params(m)
    return w.c * matmul_params(m) if w.c < 4 else 0


def gradient_bytes(m: ModelConfig, w: Where) -> tuple[int, int, int]:
    """(held through the micro-batches, reduced at the step, alive when a backward starts).
    FSDP2 without gradient sync keeps every block's unsharded gradient in its reduce_dtype until
    the last backward; XLA's layer loop reduce-scatters each block's at once. A step's only
    micro-batch starts its backward with the output head's gradient only (zero_grad freed the
    rest)."""
    P = param_count(m)
    reduced = -(-4 * P // w.shards)
    r = 2 if w.setting.reduce_dtype == "bf16" else 4
    held = r * P if w.layout == "fsdp" and not w.tpu and w.setting.accum > 1 else reduced
    first = held if w.tpu or w.setting.accum > 1 else 4 * padded_vocab(m.vocab_size) * m.n_embd
    return held, reduced, first


def runtime_bytes(w: Where) -> int:
    """CUDA: the context, and each NCCL communicator (the world's; under HSDP also the shard and
    the replica groups')."""
    if w.kind != "cuda":
        return 0
    communicators = (3 if w.layout == "fsdp" and w.world > w.shards else 1) if w.world > 1 else 0
    return RUNTIME_CUDA + communicators * NCCL_COMMUNICATOR


def reduce_buffer_bytes(m: ModelConfig, w: Where) -> int:
    """The replicated reduction's flat buckets on CPU/CUDA (train/distributed/reduce.py)."""
    if w.layout != "replicate" or w.world <= 1 or w.tpu:
        return 0
    return (2 if w.setting.reduce_dtype == "bf16" else 4) * param_count(m)


def stacked_bytes(m: ModelConfig, w: Where) -> int:
    """TPU fsdp's layer loop: one micro-batch's stacked fp32 gradient of the block weights, sharded
    like them (the backward loop builds it before adding it into the accumulators). The weights
    themselves are kept stacked for the run (train/xla/layer_scan.py: stack_blocks): no copy."""
    if not (w.tpu and w.layout == "fsdp"):
        return 0
    return -(-4 * m.n_layer * block_params(m) // w.shards)


def plan(
    m: ModelConfig,
    preset: Device,
    device_batch: int,
    seq_len: int,
    setting: Setting = DEFAULT_SETTING,
) -> MemoryPlan:
    """The memory plan for ModelConfig `m` (vocab_size 0 counts data.tokenizer.vocab_size's
    default) on `preset` at device_batch x seq_len in `setting` (layout replicate or fsdp:
    choose_layout resolves auto first): each term's function, summed by MemoryPlan."""
    if m.vocab_size <= 0:
        m = dataclasses.replace(m, vocab_size=TokenizerConfig().vocab_size)
    w = resolve(m, preset, setting)
    activations, logits, workspace = activation_bytes(m, w, seq_len, device_batch * seq_len)
    held, reduced, first = gradient_bytes(m, w)
    at_preset = int(preset.memory_gb * 1e9)
    p = MemoryPlan(
        hardware=preset.name,
        layout=w.layout,
        shards=w.shards,
        device_batch=device_batch,
        seq_len=seq_len,
        dtype=setting.dtype,
        remat=setting.remat,
        attention=w.attention,
        optimizer=setting.optimizer,
        params=param_count(m),
        weights=-(-4 * param_count(m) // w.shards),
        gradients=held,
        optimizer_state=-(-optimizer_bytes(m, setting.optimizer) // w.shards),
        compute_weights=compute_weight_bytes(m, w),
        activations=activations,
        logits=logits,
        workspace=workspace,
        device_memory=at_preset if setting.device_memory is None else setting.device_memory,
        world=w.world,
        accum=setting.accum,
        step_gradients=reduced,
        step_buffers=muon_step_bytes(m, w.kind, w.layout, w.shards, w.world, w.c)
        if setting.optimizer == "muon"
        else 0,
        reduce_buffers=reduce_buffer_bytes(m, w),
        compiled=w.compiled,
        held_gradients=first,
        runtime=runtime_bytes(w),
        load_buffers=-(-4 * largest_param(m) // w.shards),
        stacked=stacked_bytes(m, w),
    )
    return zero2_where_it_fits(p, m, w, at_preset)


def zero2_where_it_fits(p: MemoryPlan, m: ModelConfig, w: Where, at_preset: int) -> MemoryPlan:
    """FSDP2 (CPU/CUDA) keeps the gathered weights from forward to backward (one all-gather per
    block a micro-batch instead of two) when that fits with headroom, judged at the preset's
    memory, never this process's free memory: every rank must make the same choice."""
    if w.layout != "fsdp" or w.tpu:
        return p
    kept = w.c * param_count(m) + (w.c + 4) * block_params(m)
    zero2 = dataclasses.replace(p, compute_weights=kept, reshard_after_forward=False)
    return zero2 if dataclasses.replace(zero2, device_memory=at_preset).fits() else p
