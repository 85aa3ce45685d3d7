"""Hardware presets (configs/hardware/*.yaml): what a device is, how fast, how much memory, and
each model preset's sequence length and batch cap (docs/hardware.md lists them; `codex hardware`
prints the table). A GPU name with any device count works (`h100-4`: the h100 file with 4 GPUs
per host); TPU names follow Cloud TPU (v4 and v5p count TensorCores, v5e and v6e chips)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import yaml

from codex.core.config import CONFIGS_DIR, ConfigError, preset_names, preset_path
from codex.core.config.model import ModelConfig

# Per chip, from the Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p,
# v6e): HBM bandwidth, bidirectional inter-chip interconnect (ICI) bandwidth over all of a chip's
# links, and data-center network (DCN) bandwidth, which joins slices (v5e and v6e publish it per
# host NIC: 2 x 100 and 4 x 200 Gbps over 8 chips; v4 publishes none). In GB/s, DCN in Gbit/s.
CHIP_LINKS: dict[str, dict[str, float]] = {
    "v4": {"hbm": 1200.0, "ici": 600.0, "dcn_gbit": 0.0},
    "v5e": {"hbm": 819.0, "ici": 400.0, "dcn_gbit": 25.0},
    "v5p": {"hbm": 2765.0, "ici": 1200.0, "dcn_gbit": 50.0},
    "v6e": {"hbm": 1640.0, "ici": 800.0, "dcn_gbit": 100.0},
}


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
    # model preset -> {seq_len, max_device_batch (optional), batch_tokens (optional)}
    defaults: dict = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return self.devices_per_host * self.hosts

    @property
    def peak_flops(self) -> float:
        """Per-device peak in FLOP/s (0 when unknown, e.g. the CPU: no MFU then)."""
        return float(self.peak_tflops_bf16) * 1e12

    @property
    def has_step_model(self) -> bool:
        """Whether train/plan/step_time.py can time a step here: a TPU with its chip's links."""
        return self.kind == "tpu" and self.ici_bandwidth > 0

    @property
    def hbm_bandwidth(self) -> float:
        """Per-chip HBM bandwidth in bytes/s (CHIP_LINKS; 0 when not published here: GPUs, CPU)."""
        return CHIP_LINKS.get(self.family, {}).get("hbm", 0.0) * 1e9

    @property
    def ici_bandwidth(self) -> float:
        """Per-chip ICI bandwidth in bytes/s, both directions of all links (CHIP_LINKS; 0 off TPU).
        A chip receives at most half of it."""
        return CHIP_LINKS.get(self.family, {}).get("ici", 0.0) * 1e9

    @property
    def dcn_bandwidth(self) -> float:
        """Per-chip data-center network bandwidth in bytes/s (0 when unpublished); it joins slices,
        and every preset is one slice, so the step-time model never needs it."""
        return CHIP_LINKS.get(self.family, {}).get("dcn_gbit", 0.0) * 1e9 / 8


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


def list_presets() -> list[HardwarePreset]:
    def natural(name: str):  # v4-8 before v4-16
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]

    return [get_preset(n) for n in sorted(preset_names("hardware"), key=natural)]


def preset_model(name: str) -> ModelConfig:
    """The ModelConfig of model preset `name` ('default': the defaults), vocab left 0 (the plan
    counts data.tokenizer.vocab_size)."""
    from codex.core.config import build_config

    return build_config(model=None if name == "default" else name).model
