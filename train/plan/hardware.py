"""Hardware presets (configs/hardware/*.yaml): what a device is, how fast, how much memory, and
which device batch / sequence length fit each model preset.

    --hardware cpu | a100 | a100-8 | h100 | h100-8 | h200 | h200-8 | v4-8/16/32 |
               v5litepod-1/4/8/16/32 | v5p-8/16/32/64 | v6e-1/4/8/16/32
               (`codex hardware` prints the table)

A GPU name with any device count works too (`h100-4`): it is the `h100` file with 4 GPUs per host.
TPU names follow Cloud TPU: v4 and v5p names count TensorCores (v5p-8 = 4 chips, v5p-16 = 8 chips
on 2 hosts), v5e and v6e names count chips. Slices beyond one TPU VM are multi-host (`hosts` > 1,
4 chips per VM): the same command runs on every worker, so the run directory must be shared.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Literal

import yaml

from codex.core import fsio
from codex.core.config import CONFIGS_DIR, Config, ConfigError, preset_names, preset_path
from codex.core.config.model import ModelConfig
from codex.train.plan.batch import grad_accum_steps
from codex.train.plan.memory import (
    DEFAULT_SETTING,
    DEFAULT_VOCAB,
    HEADROOM,
    LayoutName,
    Setting,
    choose_layout,
    default_batch,
    fsdp_offered,
    largest_batch,
    plan,
    setting_for,
)


@dataclass
class HardwarePreset:
    name: str
    kind: str  # "cpu", "cuda" or "tpu"
    family: str  # a100, h100, h200, v4, v5e, v5p, v6e, cpu
    device_name: str
    devices_per_host: int  # GPUs or TPU chips per host (a replica each)
    hosts: int  # TPU VMs (workers) in the slice, one process each; 1 for GPU presets
    memory_gb: float  # per device (HBM)
    peak_tflops_bf16: float  # dense bf16 per device; MFU = achieved / (peak * devices)
    # model preset -> {seq_len, max_device_batch (optional)}
    defaults: dict = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return self.devices_per_host * self.hosts

    @property
    def peak_flops(self) -> float:
        """Per-device peak in FLOP/s (0 when unknown, e.g. the CPU: no MFU then)."""
        return float(self.peak_tflops_bf16) * 1e12


def _load(name: str, path) -> HardwarePreset:
    data = yaml.safe_load(open(path)) or {}
    names = {f.name for f in dataclasses.fields(HardwarePreset)} - {"name"}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)} (have: {sorted(names)})")
    missing = names - set(data) - {"defaults"}
    if missing:
        raise ConfigError(f"{path}: missing keys {sorted(missing)}")
    return HardwarePreset(name=name, **data)


def get_preset(name: str) -> HardwarePreset:
    """The preset called `name`; `h100-4` is the h100 file with 4 GPUs per host."""
    if (CONFIGS_DIR / "hardware" / f"{name}.yaml").exists():
        return _load(name, CONFIGS_DIR / "hardware" / f"{name}.yaml")
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", name)
    if m and (CONFIGS_DIR / "hardware" / f"{m.group(1)}.yaml").exists():
        base = _load(m.group(1), CONFIGS_DIR / "hardware" / f"{m.group(1)}.yaml")
        n = int(m.group(2))
        if base.kind == "cuda" and 1 <= n <= 16:
            return dataclasses.replace(base, name=name, devices_per_host=n)
    try:
        preset_path("hardware", name)  # raises the error with the list and a suggestion
    except ConfigError as e:
        raise ConfigError(f"train.hardware: {e}") from None
    raise AssertionError("unreachable")


# Environment torch_xla reads once, when it is first imported: set it before anything imports
# torch_xla (the run lock does, to ask a multi-host TPU VM for its worker id), or it has no effect.
# XLA_NO_SPECIAL_SCALARS: the Python scalars 0 and 1 stay device data like any other scalar,
# instead of constants baked into the graph (a learning rate reaching 0 or 1 would compile anew).
XLA_IMPORT_ENV = {"XLA_NO_SPECIAL_SCALARS": "1"}


def set_xla_import_env() -> None:
    for key, value in XLA_IMPORT_ENV.items():
        os.environ.setdefault(key, value)


def launch_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's environment, or 1
    process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, world, local_rank, local_world


def require_shared_run_dir(cfg) -> None:
    """A job on several hosts (a multi-host TPU preset, or torchrun over several nodes) runs the
    same command on every host, and they must all read and write one run directory: a local path
    is one folder per host (each resumes its own checkpoints, or none), so it is refused unless
    the user says it is a shared disk (train.shared_run_dir). The loop then proves it
    (ControlPlane.check_shared_dir)."""
    if fsio.is_remote(cfg.run) or cfg.train.shared_run_dir:
        return
    preset = get_preset(cfg.train.hardware)
    _, world, _, local_world = launch_env()
    if preset.hosts > 1:
        where = f"--hardware {preset.name} runs on {preset.hosts} hosts"
    elif world != local_world:
        where = (
            f"torchrun started {world} ranks, {local_world} on this node, so on several nodes "
            "(WORLD_SIZE != LOCAL_WORLD_SIZE)"
        )
    else:
        return
    raise ConfigError(
        f"{where}, but --run {cfg.run} is a local "
        "path that each host would see as its own folder. Fix: use a bucket every host reads "
        "(--run gs://BUCKET/RUN), or, when that path is a disk all hosts share (NFS, Filestore), "
        "say so with --set train.shared_run_dir=true"
    )


def list_presets() -> list[HardwarePreset]:
    def natural(name: str):  # v4-8 before v4-16
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]

    return [get_preset(n) for n in sorted(preset_names("hardware"), key=natural)]


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


def default_device_batch(
    preset: HardwarePreset,
    model_cfg: ModelConfig,
    seq_len: int,
    setting: Setting = DEFAULT_SETTING,
    batch_tokens: int = 0,
) -> tuple[int, LayoutName]:
    """(device batch, layout) the memory plan suggests (train.plan.memory.default_batch) at this
    seq_len in `setting` (its layout 'auto' too): the largest power of two that fits with
    headroom, at most MAX_DEVICE_TOKENS / seq_len and the entry's max_device_batch, accumulating
    as train.batch_tokens implies. The CPU preset's memory is the machine's, so there it is the
    entry's max_device_batch (chosen for step time; train's check against free RAM still refuses).
    0 = nothing fits."""
    _, entry = _entry(preset, model_cfg)
    cap = min(
        int(entry.get("max_device_batch", MAX_DEVICE_TOKENS)), max(1, MAX_DEVICE_TOKENS // seq_len)
    )
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


def _render(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def preset_model(name: str) -> ModelConfig:
    """The ModelConfig of model preset `name` ('default': the defaults), vocab left 0 (the plan
    counts train.plan.memory.DEFAULT_VOCAB)."""
    from codex.core.config import build_config

    return build_config(model=None if name == "default" else name).model


def format_hardware_table() -> str:
    """The `codex hardware` listing: one row per preset, plus the default device batch x seq_len per
    model preset from the memory plan (layout auto: replicated when it fits, else fsdp)."""
    presets = list_presets()
    models = []
    for p in presets:
        for k in p.defaults:
            if k not in models:
                models.append(k)
    configs = {m: preset_model(m) for m in models}
    head = ["preset", "kind", "device", "hosts", "dev/host", "mem GB", "bf16 TFLOP/s"] + [
        f"{m} B×T" for m in models
    ]
    rows = [head]
    for p in presets:
        cells = [
            p.name,
            p.kind,
            p.device_name,
            str(p.hosts),
            str(p.devices_per_host),
            f"{p.memory_gb:g}",
            f"{p.peak_tflops_bf16:g}" if p.peak_tflops_bf16 else "-",
        ]
        for m in models:
            if m not in p.defaults:
                cells.append("?")
                continue
            T = default_seq_len(p, configs[m])
            B, layout = default_device_batch(p, configs[m], T, Setting(layout="auto"))
            cells.append("-" if B <= 0 else f"{B}×{T}" + (" fsdp" if layout == "fsdp" else ""))
        rows.append(cells)
    lines = _render(rows)
    lines.append("")
    lines.append(
        "GPU presets take any device count: h100-4 = 4 H100s per host. Launch several GPUs with "
        "codex train ... --nproc-per-node N; B×T = default device batch × "
        "sequence length from the memory plan (bf16, AdamW, a 32K vocab; - = does not fit; "
        "fsdp = fits only with the weights, gradients and optimizer state sharded over every "
        "device). `codex hardware --model NAME` shows the plan. v4/v5p names count TensorCores, "
        "v5e/v6e names count chips. hosts > 1 = multi-host: run the same command on every worker "
        "(--worker=all) with a gs:// run directory."
    )
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ModelFit:
    """What `codex hardware --model` says of one preset."""

    seq_len: int
    replicate: int  # the largest device batch that fits replicated (0: none)
    fsdp: int  # the same under fsdp over every device (0: none, or fsdp does not run there)
    batch: int  # the device batch train.parallel=auto would use (0: the model does not fit)
    layout: str  # the layout auto picks, "-" when nothing fits
    total_gb: float  # the plan at that batch and layout
    remat: str = "none"  # "block" when the model fits only with train.remat=block


def model_fit(m: ModelConfig, p: HardwarePreset, setting: Setting = DEFAULT_SETTING) -> ModelFit:
    """The largest device batch (a power of two) that fits with headroom replicated and under
    fsdp, and what train.parallel=auto picks (train.plan.memory.choose_layout), in `setting`
    (its layout aside). A model that fits in neither without remat is planned again with
    train.remat=block, as MaxText's recipes recompute to fit a large model on a small slice."""
    fit = _fit(m, p, setting)
    if not fit.batch and setting.remat == "none":
        again = _fit(m, p, dataclasses.replace(setting, remat="block"))
        if again.batch:
            return dataclasses.replace(again, remat="block")
    return fit


def _fit(m: ModelConfig, p: HardwarePreset, setting: Setting) -> ModelFit:
    T = default_seq_len(p, m)
    cap = max(1, MAX_DEVICE_TOKENS // T)
    sharded = dataclasses.replace(setting, layout="fsdp")
    rep = largest_batch(m, p, T, cap, dataclasses.replace(setting, layout="replicate"))
    fsdp = largest_batch(m, p, T, cap, sharded) if fsdp_offered(p) else 0
    B = rep or fsdp
    if not B:
        return ModelFit(T, rep, fsdp, B, "-", 0.0)
    layout = choose_layout(m, p, B, T, setting)
    total = plan(m, p, B, T, dataclasses.replace(setting, layout=layout)).total / 1e9
    return ModelFit(T, rep, fsdp, B, layout, total)


def format_model_fit(
    model: str,
    optimizer: Literal["adamw", "muon"] = "adamw",
    remat: Literal["none", "block"] = "none",
) -> str:
    """`codex hardware --model NAME`: for every preset, the largest device batch (a power of two)
    that fits with headroom replicated and under fsdp over every device, and the layout
    train.parallel=auto picks (train.plan.memory.choose_layout)."""
    m = preset_model(model)
    setting = Setting(dtype="bf16", optimizer=optimizer, remat=remat)
    rows = [
        [
            "preset",
            "mem GB",
            "devices",
            "B×T max: replicate",
            "fsdp",
            "fits",
            "layout",
            "remat",
            "plan at B (GB)",
        ]
    ]
    for p in list_presets():
        if p.memory_gb <= 0:
            rows.append(
                [p.name, "-", str(p.devices), "-", "-", "?", "-", "-", "the machine's free RAM"]
            )
            continue
        f = model_fit(m, p, setting)
        T = f.seq_len
        rows.append(
            [
                p.name,
                f"{p.memory_gb:g}",
                str(p.devices),
                f"{f.replicate}×{T}" if f.replicate else "-",
                f"{f.fsdp}×{T}" if f.fsdp else "-",
                "yes" if f.batch else "no",
                f.layout,
                f.remat if f.batch else "-",
                f"{f.total_gb:.1f}" if f.batch else "-",
            ]
        )
    n = plan(m, list_presets()[0], 1, 1).params
    return "\n".join(
        [
            f"model {model}: {n / 1e6:.0f}M parameters (32K vocab), bf16, {optimizer}, "
            f"remat {remat} (block where only that fits); fits = at most {HEADROOM:.0%} of a "
            "device's memory by the plan "
            "(train/plan/memory.py), "
            f"device batch at most {MAX_DEVICE_TOKENS} tokens"
        ]
        + _render(rows)
    )


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    """`label  text` lines, the text wrapped under itself at 100 columns."""
    import textwrap

    width = max(len(label) for label, _ in rows) + 3
    out = []
    for label, text in rows:
        out += textwrap.wrap(
            text,
            100,
            initial_indent=f"  {label + ':':<{width}}",
            subsequent_indent=" " * (width + 2),
            break_on_hyphens=False,
        )
    return out


@dataclass(frozen=True)
class Batch:
    """What a run's batch resolves to before anything is built (choose_batch)."""

    device_batch: int  # B: sequences per device per micro-batch
    seq_len: int  # T
    # train.* for the memory plan: the world, the layout resolved (never auto), the accumulation
    setting: Setting
    device_batch_given: bool  # False: the memory plan's default
    seq_len_given: bool  # False: the preset's for the model

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
    data-parallel ranks, each decided here once: train.device_batch and train.seq_len, else the
    memory plan's default (device_defaults); train.parallel=auto resolved (choose_layout); the
    accumulation (train/plan/batch.py: grad_accum_steps). Both the run (train/plan/plan.py:
    resolve_batch) and `codex train --help` (format_train_plan) take it from here, so they refuse
    the same settings with the same ConfigError: a model that fits nowhere, seq_len above
    model.max_seq_len, batch_tokens that do not divide. Reads no run file and imports no torch."""
    m, t = cfg.model, cfg.train
    setting = setting_for(t, preset.kind, world)
    B, T = t.device_batch, t.seq_len
    if B <= 0 or T <= 0:
        dB, dT = device_defaults(preset, m, setting, t.batch_tokens)
        B = B if B > 0 else dB
        T = T if T > 0 else dT
    if T > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={T} is longer than model.max_seq_len={m.max_seq_len}; "
            f"lower --seq-len or --set model.max_seq_len={T}"
        )
    layout = setting.layout if setting.layout != "auto" else choose_layout(m, preset, B, T, setting)
    accum = grad_accum_steps(t.batch_tokens, B, T, world)
    setting = dataclasses.replace(setting, layout=layout, accum=accum)
    return Batch(B, T, setting, t.device_batch > 0, t.seq_len > 0)


def format_train_plan(cfg: Config, processes: int | None = None) -> list[str]:
    """What `codex train` would run with Config `cfg`, derived without the run's files or torch:
    the model shape, the hardware preset, the batch (device batch and sequence length from the
    memory plan where left at 0, as train.plan.plan.resolve_batch decides them), steps, optimizer,
    schedule, cadence and layout; `codex train --help` prints it. `processes`: --nproc-per-node
    (the world size on a CPU preset; GPU and TPU presets run one replica per device). A setting
    train would refuse at start (it does not fit, seq_len above model.max_seq_len, batch_tokens
    not a multiple) raises the same ConfigError. The plan counts a 32K vocab until the run's
    tokenizer gives the real one, so the device batch train picks may differ for a large vocab."""
    from codex.core.config.model import mlp_hidden
    from codex.core.config.train import DEFAULT_LR

    m, t = cfg.model, cfg.train
    preset = get_preset(t.hardware)
    world = (processes or 1) if preset.kind == "cpu" else preset.devices
    b = choose_batch(cfg, preset, world)
    B, T, accum, batch = b.device_batch, b.seq_len, b.accum, b.batch_tokens
    memory = plan(m, preset, B, T, b.setting)
    if b.device_batch_given:
        b_from = "given"
    elif preset.memory_gb <= 0:
        b_from = f"{preset.name}'s max_device_batch"
    else:
        b_from = f"the memory plan's at {DEFAULT_VOCAB // 1024}K vocab"
    t_from = "given" if b.seq_len_given else f"{preset.name}'s for {m.preset or 'a custom model'}"
    steps = -(-t.max_tokens // batch) if t.max_tokens > 0 else t.max_steps
    vocab = (
        f"vocab_size={m.vocab_size}"
        if m.vocab_size
        else f"vocab_size=0 (the run's tokenizer's; the plan counts {DEFAULT_VOCAB})"
    )
    lr = t.lr or DEFAULT_LR[t.optimizer]
    memory_of = f" of {preset.memory_gb:g} GB" if preset.memory_gb > 0 else " (the machine's RAM)"
    rows = [
        (
            "model",
            f"{m.preset or 'no preset (the model.* defaults)'}: "
            + (f"depth={m.depth} -> " if m.depth else "")
            + f"n_layer={m.n_layer} n_embd={m.n_embd} n_head={m.n_head} n_kv_head={m.n_kv_head} "
            f"mlp={m.mlp} mlp_hidden={mlp_hidden(m)} max_seq_len={m.max_seq_len} {vocab}; "
            f"{memory.params / 1e6:.1f}M parameters",
        ),
        (
            "hardware",
            f"{preset.name}: kind={preset.kind} ({preset.device_name}) devices={preset.devices} "
            f"({preset.devices_per_host} per host) hosts={preset.hosts}"
            + (f", {preset.memory_gb:g} GB each" if preset.memory_gb > 0 else ""),
        ),
        (
            "batch",
            f"device_batch={B} ({b_from}) x seq_len={T} ({t_from}) x world={world} = "
            f"{b.micro_tokens:,} tokens a micro-batch; batch_tokens={batch:,} a step (accum {accum}"
            + ("; train.batch_tokens=0: one micro-batch)" if t.batch_tokens <= 0 else ")"),
        ),
        (
            "steps",
            f"max_steps={steps}"
            + (f" (from codex.train.max_tokens={t.max_tokens:,})" if t.max_tokens > 0 else "")
            + f", {steps * batch:,} tokens",
        ),
        (
            "optimizer",
            f"{t.optimizer}: lr={lr:g}"
            + (f" (train.lr=0: the {t.optimizer} default)" if not t.lr else "")
            + (
                f" muon_lr={t.muon_lr:g} muon_momentum={t.muon_momentum:g}"
                if t.optimizer == "muon"
                else ""
            )
            + f" weight_decay={t.weight_decay:g} beta1={t.beta1:g} beta2={t.beta2:g} "
            f"grad_clip={t.grad_clip:g}",
        ),
        (
            "schedule",
            f"{t.schedule}: warmup_steps={t.warmup_steps}, then down to min_lr_ratio="
            f"{t.min_lr_ratio:g}"
            + (
                f" over the last decay_fraction={t.decay_fraction:g}" if t.schedule == "wsd" else ""
            ),
        ),
        (
            "cadence",
            f"log_every={t.log_every} eval_every={t.eval_every}"
            + (" (off)" if t.eval_every <= 0 else "")
            + f" eval_tokens={t.eval_tokens}"
            + (" (the whole validation split)" if t.eval_tokens <= 0 else "")
            + f" save_every={t.save_every}"
            + (" (only at the end)" if t.save_every <= 0 else "")
            + f" keep_last={t.keep_last}",
        ),
        (
            "parallel",
            f"parallel={t.parallel}"
            + (f" -> {b.setting.layout} (the memory plan's choice)" if t.parallel == "auto" else "")
            + f" fsdp_size={t.fsdp_size} remat={t.remat} dtype={t.dtype}"
            + (f" -> {b.setting.dtype}" if t.dtype == "auto" else "")
            + f"; memory plan {memory.total / 1e9:.2f} GB per device{memory_of}",
        ),
    ]
    return _rows(rows)
