"""The batch: train.batch_tokens = device_batch x seq_len x world x accum, the tokens of one
optimizer step. Chosen here (`choose_batch`: the device batch and sequence length, given or the
plan's; on TPU the fastest modelled step among those that fit (`fastest`, step_time.py), elsewhere
the largest that fits; the layout train.parallel=auto resolves to, the remat, the accumulation)
and checked here (`check_fits`: refused with the fixes that fit, exit 2). Asks memory.py for
plans; reads no run file and imports no torch."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Literal

from codex.core.config import Config, ConfigError
from codex.core.config.model import ModelConfig
from codex.core.config.train import TrainConfig
from codex.train.plan.memory import (
    DEFAULT_SETTING,
    Device,
    LayoutName,
    MemoryPlan,
    Setting,
    plan,
    setting_for,
)
from codex.train.plan.presets import HardwarePreset
from codex.train.plan.step_time import Chip, StepTime, step_time


def micro_batches(batch_tokens: int, device_batch: int, seq_len: int, world: int) -> int:
    """Micro-batches per optimizer step at this device batch: batch_tokens / (device_batch x
    seq_len x world), 1 when batch_tokens is 0. A candidate batch that leaves a remainder counts
    the whole micro-batches (at least one): were the search to pick it, grad_accum_steps refuses
    it and names the device batches that divide."""
    return max(1, batch_tokens // max(1, device_batch * seq_len * world))


def grad_accum_steps(batch_tokens: int, device_batch: int, seq_len: int, world_size: int) -> int:
    """accum = batch_tokens / (device_batch * seq_len * world_size), or a ConfigError that lists
    the nearest valid batch_tokens and the device batch sizes that would divide."""
    per_micro = device_batch * seq_len * world_size
    accum = micro_batches(batch_tokens, device_batch, seq_len, world_size)
    if batch_tokens <= 0 or accum * per_micro == batch_tokens:
        return accum
    lo = (batch_tokens // per_micro) * per_micro
    nearest = sorted(
        (v for v in (lo, lo + per_micro) if v > 0), key=lambda v: (abs(v - batch_tokens), v)
    )
    msg = (
        f"train.batch_tokens={batch_tokens} is not a multiple of "
        "device_batch * seq_len * world_size = "
        f"{device_batch} * {seq_len} * {world_size} = {per_micro}. Nearest valid batch_tokens: "
        + " or ".join(f"{v} (accum {v // per_micro})" for v in nearest)
    )
    per_seq = seq_len * world_size
    if batch_tokens % per_seq == 0:
        seqs = batch_tokens // per_seq  # sequences per rank per step
        divisors = [b for b in range(1, seqs + 1) if seqs % b == 0]
        near = sorted(divisors, key=lambda b: (abs(b - device_batch), -b))[:4]
        msg += (
            f"; or keep it and use train.device_batch in {sorted(near)} "
            f"(accum = {seqs} / device_batch)"
        )
    else:
        msg += (
            "; no device batch fits: batch_tokens must be a multiple of "
            f"seq_len * world_size = {per_seq}"
        )
    raise ConfigError(msg)


# --- the default device batch: the largest that fits --------------------------------------------


# The most tokens one device's micro-batch holds by default (B x T): the largest any preset used
# (h200, 124m: 64 x 1024). The default token batch is B x T x devices, so a small model that
# memory would let take 1M tokens per device would silently train with a far larger batch than
# the presets' learning rates were set for; past ~64K tokens a bigger micro-batch buys no speed.
MAX_DEVICE_TOKENS = 65536


def _entry(preset: HardwarePreset, model_cfg: ModelConfig) -> tuple[str | None, dict]:
    name = model_cfg.preset or None
    entry_name = name if name in preset.defaults else "default"
    if entry_name not in preset.defaults:
        raise ConfigError(
            f"configs/hardware/{preset.name}.yaml has no defaults for model '{name}' "
            "nor a 'default' entry; set train.device_batch and train.seq_len"
        )
    return entry_name, preset.defaults[entry_name]


def default_seq_len(preset: HardwarePreset, model_cfg: ModelConfig) -> int:
    """The sequence length the preset suggests for this model (its model.preset entry, else
    'default')."""
    return int(_entry(preset, model_cfg)[1]["seq_len"])


def preset_batch_tokens(preset: HardwarePreset, model_cfg: ModelConfig) -> int:
    """The tokens a step the preset names for this model (its entry's batch_tokens); 0 = none."""
    return int(_entry(preset, model_cfg)[1].get("batch_tokens", 0))


def step_tokens(t: TrainConfig, preset: HardwarePreset, model_cfg: ModelConfig, micro: int) -> int:
    """train.batch_tokens; when it and train.device_batch are 0, the preset's batch_tokens for the
    model (preset_batch_tokens) rounded up to whole micro-batches of `micro` tokens; 0 = one
    micro-batch a step. A device batch given alone keeps meaning one micro-batch of it a step."""
    target = preset_batch_tokens(preset, model_cfg)
    if t.batch_tokens > 0 or t.device_batch > 0 or target <= 0:
        return t.batch_tokens
    return -(-target // micro) * micro


def default_device_batch(
    preset: HardwarePreset,
    model_cfg: ModelConfig,
    seq_len: int,
    setting: Setting = DEFAULT_SETTING,
    batch_tokens: int = 0,
) -> tuple[int, LayoutName]:
    """(device batch, layout) the memory plan suggests (default_batch) at this
    seq_len in `setting` (its layout 'auto' too): the largest power of two that fits with
    headroom, at most MAX_DEVICE_TOKENS / seq_len and the entry's max_device_batch, accumulating
    as train.batch_tokens implies. The CPU preset's memory is the machine's, so there it is the
    entry's max_device_batch (chosen for step time; train's check against free RAM still refuses).
    0 = nothing fits."""
    cap = device_cap(preset, model_cfg, seq_len)
    if preset.memory_gb <= 0:
        return cap, "replicate"
    return default_batch(model_cfg, preset, seq_len, cap, setting, batch_tokens)


def device_defaults(
    preset: HardwarePreset,
    model_cfg: ModelConfig,
    setting: Setting = DEFAULT_SETTING,
    batch_tokens: int = 0,
) -> tuple[int, int]:
    """(device_batch, seq_len) the preset suggests for this model in `setting` (by default bf16,
    AdamW, replicated; its layout 'auto' too), or a ConfigError when not even one sequence
    fits."""
    seq_len = default_seq_len(preset, model_cfg)
    batch, layout = default_device_batch(preset, model_cfg, seq_len, setting, batch_tokens)
    if batch <= 0:
        shard = ", or shard the state" if fsdp_offered(preset) and layout != "fsdp" else ""
        if setting.remat == "none":
            remat = dataclasses.replace(setting, remat="block")
            if default_device_batch(preset, model_cfg, seq_len, remat, batch_tokens)[0] > 0:
                shard += ", or recompute the blocks (train.remat=block: it fits then)"
        raise ConfigError(
            f"model '{model_cfg.preset or 'custom'}' does not fit on {preset.name} "
            f"({preset.memory_gb:g} GB per device, {layout}) even at train.device_batch=1 x "
            f"train.seq_len={seq_len} by the memory plan; pick hardware with more memory "
            f"or a shorter train.seq_len{shard} "
            "(`codex hardware --model NAME` shows what fits where)"
        )
    return batch, seq_len


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


# --- the fastest configuration (TPU) ------------------------------------------------------------

# A TPU step's tokens a chip when train.batch_tokens and train.device_batch are 0 and the preset
# names none: fixed, so every configuration the search weighs does the same work and the fastest
# has the best MFU. 64K a chip (512K tokens a step on 8 chips) is a usual batch for 1B-class models
# and enough micro-batches to amortise a replicated step's one all-reduce.
STEP_TOKENS_PER_DEVICE = 65536


@dataclass(frozen=True)
class Candidate:
    """One configuration of a step: its device batch, its setting (layout, remat and accumulation
    resolved), its memory plan and its modelled time."""

    device_batch: int
    setting: Setting
    memory: MemoryPlan
    time: StepTime


@dataclass(frozen=True)
class Space:
    """What the search may vary: the layouts and remats to weigh (a user's explicit one alone),
    and the device batch (0 = any that divides the step's sequences a rank, up to cap)."""

    layouts: tuple[LayoutName, ...]
    remats: tuple[Literal["none", "block"], ...]
    cap: int  # the largest device batch a default may take (device_cap)
    device_batch: int = 0


def candidates(
    m: ModelConfig, preset: Chip, seq_len: int, setting: Setting, step_tokens: int, space: Space
) -> list[Candidate]:
    """Every configuration in `space` that does `step_tokens` tokens a step (each rank's share in
    whole micro-batches) and fits with headroom, with its modelled step time."""
    world = setting.ranks(preset)
    if step_tokens <= 0 or step_tokens % (seq_len * world):
        return []
    seqs = step_tokens // (seq_len * world)  # sequences a rank a step
    if space.device_batch:
        batches = [space.device_batch] if seqs % space.device_batch == 0 else []
    else:
        batches = [b for b in range(1, min(seqs, space.cap) + 1) if seqs % b == 0]
    settings = [
        (b, dataclasses.replace(setting, layout=layout, remat=remat, accum=seqs // b))
        for layout in space.layouts
        for remat in space.remats
        for b in batches
    ]
    # every plan first, then every time: the memory plan is decided before the time is asked
    fit = [(b, s, p) for b, s in settings if (p := plan(m, preset, b, seq_len, s)).fits()]
    timed = [(b, s, p, step_time(m, preset, p)) for b, s, p in fit]
    return [Candidate(b, s, p, t) for b, s, p, t in timed if t is not None]


def fastest(found: list[Candidate]) -> Candidate | None:
    """The candidate with the shortest modelled step (the best MFU: they all do the same work);
    on a tie the first, in the order candidates() makes them (replicate, no remat, small)."""
    return min(found, key=lambda c: c.time.step_s, default=None)


def search_space(t: TrainConfig, preset: Device, world: int, cap: int) -> Space:
    """The layouts (train.parallel=auto: replicate and, where offered, fsdp) and remats
    (train.remat=auto: none and block) a TPU run's search weighs; a user's explicit one alone."""
    layouts: tuple[LayoutName, ...]
    if t.parallel != "auto":
        layouts = (t.parallel,)
    else:
        layouts = ("replicate", "fsdp") if fsdp_offered(preset, world) else ("replicate",)
    remats: tuple[Literal["none", "block"], ...] = (
        ("none", "block") if t.remat == "auto" else (t.remat,)
    )
    return Space(layouts, remats, cap, max(0, t.device_batch))


def device_cap(preset: HardwarePreset, m: ModelConfig, seq_len: int) -> int:
    """The largest device batch a default may take: MAX_DEVICE_TOKENS / seq_len, and the preset
    entry's max_device_batch where it names one."""
    _, entry = _entry(preset, m)
    limit = int(entry.get("max_device_batch", MAX_DEVICE_TOKENS))
    return min(limit, max(1, MAX_DEVICE_TOKENS // seq_len))


def modelled_step_tokens(
    t: TrainConfig, preset: HardwarePreset, m: ModelConfig, seq_len: int, world: int
) -> int:
    """The tokens of a TPU step the search splits: train.batch_tokens; else one micro-batch of a
    given train.device_batch; else the preset's batch_tokens for the model; else
    STEP_TOKENS_PER_DEVICE a chip, in whole sequences."""
    if t.batch_tokens > 0:
        return t.batch_tokens
    if t.device_batch > 0:
        return t.device_batch * seq_len * world
    per_rank = max(1, STEP_TOKENS_PER_DEVICE // seq_len) * seq_len
    target = preset_batch_tokens(preset, m)
    return -(-target // (seq_len * world)) * seq_len * world if target > 0 else per_rank * world


def best_config(
    cfg: Config, preset: HardwarePreset, world: int, seq_len: int
) -> tuple[Candidate | None, int]:
    """(the fastest candidate that fits, the step's tokens) for `cfg` on a TPU preset; None when
    nothing fits (choose_batch's old path then says why) or the preset has no step-time model."""
    m, t = cfg.model, cfg.train
    if not preset.has_step_model:
        return None, 0
    cap = device_cap(preset, m, seq_len)
    setting = setting_for(t, preset.kind, world)
    tokens = modelled_step_tokens(t, preset, m, seq_len, world)
    space = search_space(t, preset, world, cap)
    return fastest(candidates(m, preset, seq_len, setting, tokens, space)), tokens


# --- the choice ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """What a run's batch resolves to before anything is built (choose_batch)."""

    device_batch: int  # B: sequences per device per micro-batch
    seq_len: int  # T
    # train.* for the memory plan: the world, the layout resolved (never auto), the accumulation
    setting: Setting
    device_batch_given: bool  # False: the memory plan's default
    seq_len_given: bool  # False: the preset's for the model
    memory: MemoryPlan  # bytes per device at this batch, checked against this machine
    time: StepTime | None = None  # the modelled step (TPU presets; step_time.py)

    @property
    def world(self) -> int:
        return self.setting.world

    @property
    def accum(self) -> int:
        return self.setting.accum

    @property
    def micro_tokens(self) -> int:
        """Tokens of one micro-batch over every rank."""
        return self.device_batch * self.seq_len * self.world

    @property
    def batch_tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.micro_tokens * self.accum


def choose_batch(cfg: Config, preset: HardwarePreset, world: int) -> Batch:
    """The device batch, sequence length, layout and accumulation of `cfg` on `preset` over `world`
    data-parallel ranks, each decided here once (train.device_batch and train.seq_len, else the
    memory plan's default; train.parallel=auto resolved; the accumulation, from train.batch_tokens
    or the preset's: step_tokens), and the memory plan
    at that batch checked against this machine. The run and `codex train --help` both reach it
    through train/plan/plan.py: make_plan, so they refuse the same settings with the same
    ConfigError."""
    m, t = cfg.model, cfg.train
    setting = setting_for(t, preset.kind, world)
    B, T = t.device_batch, t.seq_len
    if preset.has_step_model:
        T = T if T > 0 else default_seq_len(preset, m)
        _check_seq_len(m, T)
        best, tokens = best_config(cfg, preset, world, T)
        if best is not None:  # planned at the TPU's memory, which check_fits also judges by
            b, s = best.device_batch, best.setting
            return Batch(b, T, s, B > 0, t.seq_len > 0, best.memory, best.time)
    if B <= 0 or T <= 0:
        dB, dT = device_defaults(preset, m, setting, t.batch_tokens)
        B = B if B > 0 else dB
        T = T if T > 0 else dT
    _check_seq_len(m, T)
    layout = setting.layout if setting.layout != "auto" else choose_layout(m, preset, B, T, setting)
    batch_tokens = step_tokens(t, preset, m, B * T * world)
    accum = grad_accum_steps(batch_tokens, B, T, world)
    setting = dataclasses.replace(setting, layout=layout, accum=accum)
    memory = check_fits(m, preset, B, T, setting, batch_tokens)
    return Batch(B, T, setting, t.device_batch > 0, t.seq_len > 0, memory)


def _check_seq_len(m: ModelConfig, T: int) -> None:
    if T > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={T} is longer than model.max_seq_len={m.max_seq_len}; "
            f"lower --seq-len or --set model.max_seq_len={T}"
        )


# --- the refusal ---------------------------------------------------------------------------------


def available_bytes(kind: str, preset_memory_gb: float) -> int | None:
    """Memory one process may use: the GPU's own total memory when CUDA is up in this process (an
    A100 may have 40 or 80 GB), else the preset's device memory on accelerators; on the CPU
    MemAvailable divided by the processes on this host; None when unknown."""
    torch = sys.modules.get("torch")  # a run has imported it; --help never imports torch
    if kind == "cuda" and torch is not None:
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
