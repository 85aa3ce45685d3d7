"""How long one host takes to write a checkpoint, and whether a save on SIGTERM ends within a spot
VM's notice (train.preempt_notice_s): the bytes a host writes (the plan's fp32 weights and
optimizer state, over the hosts) at the write rate bench/bench_checkpoint_streams.py measured.

    t = save_time(memory_plan, hosts, remote=True)   # t.seconds
    line = preempt_warning(t, notice_s)              # None when the save ends in time
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from codex.core.config.model import ModelConfig
from codex.train.plan.memory import MemoryPlan, Setting, plan
from codex.train.plan.presets import HardwarePreset

# Bytes a second one host writes a checkpoint at through train/checkpoint/streams.py's 16
# streams. Local disk: bench/bench_checkpoint_streams.py's "16 streams" row (docs/checkpoints.md,
# "Save time"). gs://: an assumption, not a measurement: the bench against the GCS emulator on a
# shared 2-core VM gives a floor 25x lower (one single-threaded server), while a TPU VM's network
# and GCS serve each stream on its own. A run's train.save_rate_gbs replaces both; measure it with
# the bench's --gs gs://BUCKET/PREFIX on the VM.
HOST_WRITE_RATE = {"local": 0.3e9, "gs": 1.0e9}


@dataclass(frozen=True)
class SaveTime:
    bytes_per_host: int
    hosts: int
    where: str  # "gs" (an object store) or "local": the key of HOST_WRITE_RATE
    rate_gbs: float = 0.0  # train.save_rate_gbs; 0 = HOST_WRITE_RATE[where]

    @property
    def rate(self) -> float:
        return self.rate_gbs * 1e9 if self.rate_gbs > 0 else HOST_WRITE_RATE[self.where]

    @property
    def seconds(self) -> float:
        return self.bytes_per_host / self.rate


def host_save_bytes(memory: MemoryPlan, hosts: int) -> int:
    """Bytes one host writes at a save: one copy of the state (the fp32 weights and the optimizer
    state, each shard once) spread over the hosts, as DCP writes it: each host its own shards,
    a replicated tensor by one host (train/checkpoint/dcp.py)."""
    state = (memory.weights + memory.optimizer_state) * memory.shards
    return -(-state // max(1, hosts))


def hosts_of(preset: HardwarePreset, world: int) -> int:
    """The machines a run writes from: a TPU slice's hosts; torchrun's ranks over the GPUs a host
    has; one for the CPU."""
    if preset.kind == "cuda":
        return max(1, -(-world // max(1, preset.devices_per_host)))
    return max(1, preset.hosts)


def save_time(memory: MemoryPlan, hosts: int, remote: bool, rate_gbs: float = 0.0) -> SaveTime:
    return SaveTime(host_save_bytes(memory, hosts), hosts, "gs" if remote else "local", rate_gbs)


def tpu_save_seconds(m: ModelConfig, p: HardwarePreset, setting: Setting, layout: str) -> str:
    """`codex hardware --model`'s cell: a save's seconds on a TPU slice (to gs://, as a multi-host
    run writes); "-" for other presets or when nothing fits (layout "-")."""
    if p.kind != "tpu" or layout not in ("replicate", "fsdp"):
        return "-"
    memory = plan(m, p, 1, 1, replace(setting, layout=layout))  # type: ignore[arg-type]
    return f"{save_time(memory, p.hosts, remote=True).seconds:.0f}"


def preempt_warning(t: SaveTime, notice_s: float) -> str | None:
    """The line codex logs at start when a save cannot end within `notice_s` (0: never)."""
    if notice_s <= 0 or t.seconds <= notice_s:
        return None
    where = "gs://" if t.where == "gs" else "the local disk"
    return (
        f"a checkpoint save on SIGTERM cannot finish within train.preempt_notice_s="
        f"{notice_s:g} s: each of {t.hosts} host(s) writes {t.bytes_per_host / 1e9:.2f} GB at "
        f"{t.rate / 1e9:.2f} GB/s to {where} (train.save_rate_gbs, else "
        f"train/plan/save_time.py: HOST_WRITE_RATE), about "
        f"{t.seconds:.0f} s; a preempted VM would lose the steps since the last checkpoint. "
        "Write fewer bytes per host (a smaller model, train.optimizer=muon), spread them over "
        "more hosts, or raise train.preempt_notice_s where the VM's notice is longer"
    )
