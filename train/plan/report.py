"""What the planner says to people: `codex hardware`'s table and `--model` fit, `codex train
--help`'s plan, and the memory plan's breakdown. Formats plans computed elsewhere (plan.py,
batch.py, memory.py); decides nothing."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Literal

from codex.core.config import Config
from codex.core.config.data import TokenizerConfig
from codex.core.config.model import ModelConfig, mlp_hidden
from codex.core.config.train import TrainConfig
from codex.train.plan import batch
from codex.train.plan.batch import (
    MAX_DEVICE_TOKENS,
    choose_layout,
    default_device_batch,
    default_seq_len,
    fsdp_offered,
    largest_batch,
    preset_batch_tokens,
)
from codex.train.plan.memory import DEFAULT_SETTING, HEADROOM, MemoryPlan, Setting, plan
from codex.train.plan.plan import Plan, make_plan, planned_vocab, tokenizer_vocab
from codex.train.plan.presets import HardwarePreset, get_preset, list_presets, preset_model
from codex.train.plan.save_time import tpu_save_seconds
from codex.train.plan.step_time import StepTime


def _vocab_k() -> str:
    """data.tokenizer.vocab_size's default, which the plan counts for a model without a run."""
    return f"{TokenizerConfig().vocab_size // 1024}K"


def _render(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


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
            _memory_cell(p),
            f"{p.peak_tflops_bf16:g}" if p.peak_tflops_bf16 else "-",
        ]
        for m in models:
            if m not in p.defaults:
                cells.append("?")
                continue
            cells.append(_default_cell(p, configs[m]))
        rows.append(cells)
    lines = _render(rows)
    lines.append("")
    lines.append(
        "GPU presets take any device count: h100-4 = 4 H100s per host. Launch several GPUs with "
        "codex train ... --nproc-per-node N; B×T = default device batch × "
        f"sequence length (bf16, AdamW, a {_vocab_k()} vocab; - = does not fit): on TPU the "
        "fastest modelled step that fits (train/plan/step_time.py; fsdp = the weights, gradients "
        "and optimizer state sharded over every device, remat = train.remat=block), elsewhere "
        "the memory plan's largest that fits (fsdp = fits only sharded). cpu's mem GB is the RAM "
        "free on this machine now (MemAvailable), what train's memory plan is checked against. "
        "`codex hardware --model NAME` shows the plan. v4/v5p names count TensorCores, "
        "v5e/v6e names count chips. hosts > 1 = multi-host: run the same command on every worker "
        "(--worker=all) with a gs:// run directory."
    )
    return "\n".join(lines)


def _default_cell(p: HardwarePreset, m: ModelConfig) -> str:
    """The device batch x seq_len a run of model `m` uses on `p` by default (layout auto; remat
    auto on TPU, where the fastest modelled step picks them)."""
    if p.has_step_model:
        f = model_fit(m, p)
        if not f.batch:
            return "-"
        tags = (" fsdp" if f.layout == "fsdp" else "") + (" remat" if f.remat == "block" else "")
        return f"{f.batch}×{f.seq_len}" + tags
    T = default_seq_len(p, m)
    B, layout = default_device_batch(p, m, T, Setting(layout="auto"))
    return "-" if B <= 0 else f"{B}×{T}" + (" fsdp" if layout == "fsdp" else "")


def _memory_cell(p: HardwarePreset) -> str:
    """A preset's memory per device in GB; a preset without one (the CPU) is this machine's free
    RAM, the number train's memory plan is checked against (batch.py: available_bytes)."""
    if p.memory_gb > 0:
        return f"{p.memory_gb:g}"
    free = batch.available_bytes(p.kind, p.memory_gb)
    return f"{free / 1e9:.1f} free" if free is not None else "? free"


@dataclasses.dataclass(frozen=True)
class ModelFit:
    """What `codex hardware --model` says of one preset."""

    seq_len: int
    replicate: int  # the largest device batch that fits replicated (0: none)
    fsdp: int  # the same under fsdp over every device (0: none, or fsdp does not run there)
    batch: int  # the device batch a run would use (0: the model does not fit)
    layout: str  # the layout a run would use, "-" when nothing fits
    total_gb: float  # the plan at that batch and layout
    remat: str = "none"  # the run's train.remat
    remat_batch: int = 0  # the largest device batch with train.remat=block (fsdp where offered)
    accum: int = 1  # micro-batches a step (TPU: of the step's STEP_TOKENS_PER_DEVICE a chip)
    time: StepTime | None = None  # the modelled step (TPU presets)


def model_fit(m: ModelConfig, p: HardwarePreset, setting: Setting = DEFAULT_SETTING) -> ModelFit:
    """The largest device batch (a power of two) that fits with headroom replicated and under
    fsdp, and with remat; and what a run would use, in `setting` (its layout and remat aside).
    On TPU that is the fastest modelled step among the configurations that fit (batch.py:
    candidates, fastest; train.parallel and train.remat auto). Elsewhere the largest batch that
    fits in the layout train.parallel=auto picks (choose_layout), with train.remat=block only when
    nothing fits without it, as MaxText's recipes recompute to fit a large model on a small
    slice."""
    if p.has_step_model:
        return _fastest_fit(m, p, setting)
    fit = _fit(m, p, setting)
    if not fit.batch and setting.remat == "none":
        again = _fit(m, p, dataclasses.replace(setting, remat="block"))
        if again.batch:
            return dataclasses.replace(again, remat="block", remat_batch=again.batch)
    return fit


def _fastest_fit(m: ModelConfig, p: HardwarePreset, setting: Setting) -> ModelFit:
    T = default_seq_len(p, m)
    cap = batch.device_cap(p, m, T)
    rep = largest_batch(m, p, T, cap, dataclasses.replace(setting, layout="replicate"))
    sharded = dataclasses.replace(setting, layout="fsdp")
    fsdp = largest_batch(m, p, T, cap, sharded) if fsdp_offered(p) else 0
    wide = sharded if fsdp_offered(p) else dataclasses.replace(setting, layout="replicate")
    remat = largest_batch(m, p, T, cap, dataclasses.replace(wide, remat="block"))
    tokens = batch.modelled_step_tokens(TrainConfig(), p, m, T, p.devices)
    space = batch.search_space(TrainConfig(), p, p.devices, cap)
    best = batch.fastest(batch.candidates(m, p, T, setting, tokens, space))
    if best is None:
        return ModelFit(T, rep, fsdp, 0, "-", 0.0, remat_batch=remat)
    s = best.setting
    return ModelFit(
        T, rep, fsdp, best.device_batch, s.layout, best.memory.total / 1e9, s.remat, remat,
        s.accum, best.time,
    )  # fmt: skip


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
    that fits with headroom replicated, under fsdp over every device and with remat, and the
    configuration a run would use (model_fit) with its memory and, on TPU, its modelled step time
    and MFU (train/plan/step_time.py)."""
    m = preset_model(model)
    setting = Setting(dtype="bf16", optimizer=optimizer, remat=remat)
    head = ["preset", "mem GB", "devices", "largest B×T: replicate", "fsdp", "remat"]
    head += ["run: layout", "remat", "B×T", "micro", "GB", "step s", "MFU", "bound", "save s"]
    rows = [head]
    for p in list_presets():
        f = model_fit(m, p, setting) if p.memory_gb > 0 else None
        save = tpu_save_seconds(m, p, setting, f.layout if f and f.batch else "-")
        rows.append(_fit_row(p, f) + [save])
    n = plan(m, list_presets()[0], 1, 1).params
    per_chip = f"{batch.STEP_TOKENS_PER_DEVICE:,}"
    return "\n".join(
        [
            f"model {model}: {n / 1e6:.0f}M parameters ({_vocab_k()} vocab), bf16, {optimizer}; "
            f"fits = at most {HEADROOM:.0%} of a device's memory by the plan "
            f"(train/plan/memory.py), device batch at most {MAX_DEVICE_TOKENS} tokens. run = what "
            f"codex train uses: on TPU the fastest modelled step of {per_chip} tokens a chip "
            "that fits (train/plan/step_time.py: FLOPs at the bf16 peak, HBM, ICI; MFU in "
            "MaxText's convention, an upper bound), elsewhere the largest batch that fits, with "
            "remat only where nothing fits without; save s = a checkpoint save's seconds on a TPU "
            "slice, each host writing its share to gs:// (train/plan/save_time.py)"
        ]
        + _render(rows)
    )


def _fit_row(p: HardwarePreset, f: ModelFit | None) -> list[str]:
    """One preset's cells of format_model_fit (None: the CPU, whose memory is this machine's)."""
    if f is None:
        return [p.name, "-", str(p.devices)] + ["-"] * 7 + ["its RAM", "-", "-", "-"]
    T = f.seq_len
    bt = lambda b: f"{b}×{T}" if b else "-"  # noqa: E731
    cells = [p.name, f"{p.memory_gb:g}", str(p.devices), bt(f.replicate), bt(f.fsdp)]
    cells.append(bt(f.remat_batch))
    if not f.batch:
        return cells + ["-"] * 8
    cells += [f.layout, f.remat, bt(f.batch), str(f.accum), f"{f.total_gb:.1f}"]
    t = f.time
    cells += [f"{t.step_s:.3g}", f"{t.mfu:.0%}", t.bound] if t else ["-", "-", "-"]
    return cells


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    """`label  text` lines, the text wrapped under itself at 100 columns."""
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


def format_train_plan(cfg: Config, processes: int | None = None) -> list[str]:
    """What `codex train` would run with Config `cfg`: the Plan make_plan derives without torch,
    formatted; `codex train --help` prints it. The vocab is the run's tokenizer's where RUN has
    one (tokenizer_vocab), as training counts it; else planned_vocab. `processes`:
    --nproc-per-node (the world size on a CPU preset; GPU and TPU presets run one replica per
    device). A setting train would refuse at start raises the same ConfigError."""
    preset = get_preset(cfg.train.hardware)
    world = (processes or 1) if preset.kind == "cpu" else preset.devices
    found = tokenizer_vocab(cfg)
    vocab = found if found is not None else planned_vocab(cfg)
    resolved, p = make_plan(cfg, preset, world, vocab=vocab)[:2]
    rows = [
        ("model", _model_row(cfg, resolved, p, found is not None)),
        ("hardware", _hardware_row(preset)),
        ("batch", _batch_row(cfg, p)),
        ("steps", _steps_row(cfg, p)),
        ("optimizer", _optimizer_row(cfg, resolved)),
        ("schedule", _schedule_row(cfg)),
        ("cadence", _cadence_row(cfg)),
        ("parallel", _parallel_row(cfg, p)),
    ]
    return _rows(rows)


def _model_row(cfg: Config, resolved: Config, p: Plan, read: bool) -> str:
    """read: p.vocab is the run's tokenizer's (RUN/tokenizer/tokenizer_meta.json)."""
    m = cfg.model
    if m.vocab_size:
        vocab = f"vocab_size={m.vocab_size}"
    elif read:
        vocab = f"vocab_size=0 (the run's tokenizer's: {p.vocab})"
    else:
        vocab = (
            "vocab_size=0 (the run's tokenizer's; "
            + ("a gs:// run is not read" if "://" in cfg.run else "RUN has none yet")
            + f": data.tokenizer.vocab_size={p.vocab})"
        )
    return (
        f"{m.preset or 'no preset (the model.* defaults)'}: "
        + (f"depth={m.depth} -> " if m.depth else "")
        + f"n_layer={m.n_layer} n_embd={m.n_embd} n_head={m.n_head} n_kv_head={m.n_kv_head} "
        f"mlp={m.mlp} mlp_hidden={mlp_hidden(resolved.model)} max_seq_len={m.max_seq_len} "
        f"{vocab}; {p.memory.params / 1e6:.2f}M parameters"
    )


def _hardware_row(preset: HardwarePreset) -> str:
    return (
        f"{preset.name}: kind={preset.kind} ({preset.device_name}) devices={preset.devices} "
        f"({preset.devices_per_host} per host) hosts={preset.hosts}"
        + (f", {preset.memory_gb:g} GB each" if preset.memory_gb > 0 else "")
    )


def _batch_row(cfg: Config, p: Plan) -> str:
    preset = p.preset
    if p.device_batch_given:
        b_from = "given"
    elif preset.memory_gb <= 0:
        b_from = f"{preset.name}'s max_device_batch"
    elif p.time is not None:
        b_from = "the fastest modelled step's"
    else:
        b_from = "the memory plan's"
    t_from = (
        "given"
        if p.seq_len_given
        else f"{preset.name}'s for {cfg.model.preset or 'a custom model'}"
    )
    micro = p.device_batch * p.seq_len * p.world_size
    return (
        f"device_batch={p.device_batch} ({b_from}) x seq_len={p.seq_len} ({t_from}) x "
        f"world={p.world_size} = {micro:,} tokens a micro-batch; batch_tokens={p.batch_tokens:,} "
        f"a step (accum {p.accum}" + _batch_tokens_from(cfg, p) + ")"
    )


def _batch_tokens_from(cfg: Config, p: Plan) -> str:
    t = cfg.train
    if t.batch_tokens > 0:
        return ""
    target = preset_batch_tokens(p.preset, cfg.model) if t.device_batch <= 0 else 0
    if target <= 0 and p.time is not None and t.device_batch <= 0:
        return f"; train.batch_tokens=0: {batch.STEP_TOKENS_PER_DEVICE:,} tokens a chip"
    if target <= 0:
        return "; train.batch_tokens=0: one micro-batch"
    return (
        f"; train.batch_tokens=0: {p.preset.name}'s {target:,} for "
        f"{cfg.model.preset or 'a custom model'}, in whole micro-batches"
    )


def _steps_row(cfg: Config, p: Plan) -> str:
    t = cfg.train
    return (
        f"max_steps={p.total_steps}"
        + (f" (from codex.train.max_tokens={t.max_tokens:,})" if t.max_tokens > 0 else "")
        + f", {p.total_steps * p.batch_tokens:,} tokens"
    )


def _optimizer_row(cfg: Config, resolved: Config) -> str:
    t = cfg.train
    muon = (
        f" muon_lr={t.muon_lr:g} muon_momentum={t.muon_momentum:g}" if t.optimizer == "muon" else ""
    )
    return (
        f"{t.optimizer}: lr={resolved.train.lr:g}"
        + (f" (train.lr=0: the {t.optimizer} default)" if not t.lr else "")
        + muon
        + f" weight_decay={t.weight_decay:g} beta1={t.beta1:g} beta2={t.beta2:g} "
        f"grad_clip={t.grad_clip:g}"
    )


def _schedule_row(cfg: Config) -> str:
    t = cfg.train
    return (
        f"{t.schedule}: warmup_steps={t.warmup_steps}, then down to min_lr_ratio="
        f"{t.min_lr_ratio:g}"
        + (f" over the last decay_fraction={t.decay_fraction:g}" if t.schedule == "wsd" else "")
    )


def _cadence_row(cfg: Config) -> str:
    t = cfg.train
    return (
        f"log_every={t.log_every} eval_every={t.eval_every}"
        + (" (off)" if t.eval_every <= 0 else "")
        + f" eval_tokens={t.eval_tokens}"
        + (" (the whole validation split)" if t.eval_tokens <= 0 else "")
        + f" save_every={t.save_every}"
        + (" (only at the end)" if t.save_every <= 0 else "")
        + f" keep_last={t.keep_last}"
    )


def _parallel_row(cfg: Config, p: Plan) -> str:
    t, memory = cfg.train, p.memory
    memory_gb = p.preset.memory_gb
    memory_of = f" of {memory_gb:g} GB" if memory_gb > 0 else " (the machine's RAM)"
    return (
        f"parallel={t.parallel}"
        + (f" -> {memory.layout} (the plan's choice)" if t.parallel == "auto" else "")
        + f" fsdp_size={t.fsdp_size} remat={t.remat}"
        + (f" -> {memory.remat}" if t.remat == "auto" else "")
        + f" dtype={t.dtype}"
        + (f" -> {memory.dtype}" if t.dtype == "auto" else "")
        + f"; memory plan {memory.total / 1e9:.2f} GB per device{memory_of}"
        + _time_text(p)
    )


def _time_text(p: Plan) -> str:
    """The modelled step (TPU presets), for the parallel row."""
    t = p.time
    if t is None:
        return ""
    return (
        f"; modelled step {t.step_s:.3g} s, MFU {t.mfu:.0%} ({t.bound}-bound; compute "
        f"{t.compute_s:.3g} s, HBM {t.hbm_s:.3g} s, ICI {t.ici_s:.3g} s of which "
        f"{t.exposed_ici_s:.3g} s not hidden: train/plan/step_time.py)"
    )


def memory_lines(self: MemoryPlan) -> list[str]:
    """The memory plan's readable breakdown, logged at start."""
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
        f"memory plan: {self.params / 1e6:.2f}M params on {self.hardware} ({mem} per device), "
        f"{layout}, device batch {self.device_batch} x {self.seq_len}{accum}, {self.dtype}, "
        f"{self.attention} attention"
    )
    peak = " (at the optimizer step)" if self.step > self.backward else ""
    if self.load_buffers > max(self.step, self.backward):
        peak = " (at resume)"
    share = (
        f" ({self.total / self.device_memory:.0%} of the device)" if self.device_memory > 0 else ""
    )
    return (
        [head]
        + [f"  {name:<30}{gb(n)}" for name, n in parts if n]
        + [f"  {'total':<30}{gb(self.total)}{share}{peak}"]
    )
