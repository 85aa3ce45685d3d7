"""Hardware presets (configs/hardware/*.yaml): what a device is, how fast, how much memory, and
which device batch / sequence length fit each model preset.

    --hardware cpu | a100 | a100-8 | h100 | h100-8 | h200 | h200-8 | v4-8/16/32 |
               v5litepod-1/4/8/16/32 | v5p-8/16/32/64 | v6e-1/4/8/16/32   (`codex hardware` prints the table)

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

import yaml

from codex import fsio
from codex.config import CONFIGS_DIR, ConfigError, preset_names, preset_path


@dataclass
class HardwarePreset:
    name: str
    kind: str                   # "cpu", "cuda" or "tpu"
    family: str                 # a100, h100, h200, v4, v5e, v5p, v6e, cpu
    device_name: str
    devices_per_host: int       # GPUs or TPU chips per host (a replica each)
    hosts: int                  # TPU VMs (workers) in the slice, one process each; 1 for GPU presets
    memory_gb: float            # per device (HBM)
    peak_tflops_bf16: float     # dense bf16 per device; MFU = achieved / (peak * devices)
    defaults: dict = field(default_factory=dict)   # model preset -> {device_batch, seq_len} | None

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


def require_shared_run_dir(cfg) -> None:
    """A multi-host preset runs the same command on every worker, and they must all read and write
    one run directory: a local path is one folder per host (each resumes its own checkpoints, or
    none), so it is refused unless the user says it is a shared disk (train.shared_run_dir)."""
    preset = get_preset(cfg.train.hardware)
    if preset.hosts <= 1 or fsio.is_remote(cfg.run) or cfg.train.shared_run_dir:
        return
    raise ConfigError(
        f"--hardware {preset.name} runs on {preset.hosts} hosts, but --run {cfg.run} is a local path that each host "
        "would see as its own folder. Fix: use a bucket every host reads (--run gs://BUCKET/RUN), or, when that path "
        "is a disk all hosts share (NFS, Filestore), say so with --set train.shared_run_dir=true")


def list_presets() -> list[HardwarePreset]:
    def natural(name: str):   # v4-8 before v4-16
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]

    return [get_preset(n) for n in sorted(preset_names("hardware"), key=natural)]


def device_defaults(preset: HardwarePreset, model_cfg) -> tuple[int, int]:
    """(device_batch, seq_len) the preset suggests for this model (its model.preset entry, else
    'default'), or a ConfigError when it does not fit."""
    name = model_cfg.preset or None
    entry_name = name if name in preset.defaults else "default"
    if entry_name not in preset.defaults:
        raise ConfigError(f"configs/hardware/{preset.name}.yaml has no defaults for model '{name}' nor a 'default' "
                          "entry; set train.device_batch and train.seq_len")
    entry = preset.defaults[entry_name]
    if entry is None:
        raise ConfigError(f"model preset '{name}' does not fit on {preset.name} ({preset.memory_gb:g} GB per "
                          "device) with data parallelism; pick larger hardware, or set train.device_batch and "
                          "train.seq_len to try anyway")
    return int(entry["device_batch"]), int(entry["seq_len"])


def format_hardware_table() -> str:
    """The `codex hardware` listing: one row per preset, plus the device batch / seq_len defaults."""
    presets = list_presets()
    models = []
    for p in presets:
        for k in p.defaults:
            if k not in models:
                models.append(k)
    head = ["preset", "kind", "device", "hosts", "dev/host", "mem GB", "bf16 TFLOP/s"] + [f"{m} B×T" for m in models]
    rows = [head]
    for p in presets:
        cells = [p.name, p.kind, p.device_name, str(p.hosts), str(p.devices_per_host), f"{p.memory_gb:g}",
                 f"{p.peak_tflops_bf16:g}" if p.peak_tflops_bf16 else "-"]
        for m in models:
            e = p.defaults.get(m, "?")
            cells.append("-" if e is None else "?" if e == "?" else f"{e['device_batch']}×{e['seq_len']}")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("GPU presets take any device count: h100-4 = 4 H100s per host. Launch several GPUs with "
                 "torchrun --nproc_per_node=N -m train ...; B×T = default device batch × sequence length "
                 "(- = does not fit). v4/v5p names count TensorCores, v5e/v6e names count chips. hosts > 1 = "
                 "multi-host: run the same command on every worker (--worker=all) with a gs:// run directory.")
    return "\n".join(lines)
