"""CPU threads per process: train.threads, or the physical cores of this machine (those this
process may use, within its container's CPU quota) divided by the training processes on it; a
single process leaves out the cores other processes keep busy when it starts.

    threads = apply_threads(cfg.train.threads)   # once, before the first tensor op

Applied to torch's intra-op pool (OpenMP in this process) and the tokenizers' pool
(RAYON_NUM_THREADS, read when tokenizers first builds it). An
OMP_NUM_THREADS already set wins over the default (torchrun sets 1 per process when it starts
several; `codex train --nproc-per-node N` sets the default instead). torch's own
default is every logical CPU of the machine in every process: with SMT siblings, several local
processes or a container quota below the machine's size, its threads outnumber the cores they
run on, and OpenMP threads that wait for each other make such a run several times slower.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from codex.train.plan.world import launch_env


@dataclass(frozen=True)
class Threads:
    n: int
    why: str  # "train.threads", or how the default was derived

    def describe(self) -> str:
        return f"{self.n} CPU thread{'s' if self.n != 1 else ''} per process ({self.why})"


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return sorted(affinity(0)) if affinity else list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int], sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """Distinct physical cores among `cpus` (SMT siblings count once); len(cpus) where the
    topology cannot be read."""
    cores = set()
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            package = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return len(cores) or len(cpus)


def cgroup_cpu_limit(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """The container's CPU quota in CPUs (cgroup v2 `cpu.max`), None when unlimited or unknown."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def _cpu_times(cpus: list[int], stat: Path) -> tuple[int, int]:
    """(busy, total) jiffies of `cpus` from /proc/stat's per-CPU lines."""
    busy = total = 0
    wanted = {f"cpu{c}" for c in cpus}
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if name in wanted:
            ticks = [int(x) for x in fields[:8]]
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return busy, total


def busy_cores(
    cpus: list[int], sample_s: float = 0.25, stat: Path = Path("/proc/stat")
) -> float | None:
    """How many of `cpus` other processes keep busy now (sampled over sample_s; this process
    sleeps meanwhile), or None where /proc/stat cannot be read."""
    try:
        b0, t0 = _cpu_times(cpus, stat)
        time.sleep(sample_s)
        b1, t1 = _cpu_times(cpus, stat)
    except (OSError, ValueError):
        return None
    return len(cpus) * (b1 - b0) / (t1 - t0) if t1 > t0 else None


def default_threads(local_processes: int) -> Threads:
    cpus = usable_cpus()
    cores = physical_cores(cpus)
    limit = cgroup_cpu_limit()
    why = f"{cores} physical cores"
    if limit is not None and math.ceil(limit) < cores:
        cores = max(1, math.ceil(limit))
        why = f"a CPU quota of {limit:g}"
    elif local_processes == 1:
        # One process, no quota: cores that other jobs keep busy are not ours. OpenMP threads wait
        # for the slowest of them, so a thread sharing a core with a busy process slows them all.
        # (With several local processes they would count each other, starting at the same time.)
        busy = busy_cores(cpus)
        if busy is not None and round(busy) > 0:
            cores = max(1, cores - round(busy))
            why += f" - {busy:.1f} kept busy by other processes"
    n = max(1, cores // max(1, local_processes))
    if local_processes > 1:
        why += f" / {local_processes} processes on this machine"
    return Threads(n, f"default: {why}; set train.threads to change")


def apply_threads(requested: int) -> Threads:
    """Set this process's CPU threads: `requested` (train.threads) when > 0, else OMP_NUM_THREADS
    when it is set (by the user, or by torchrun: 1 per process), else the default for the training
    processes on this machine (LOCAL_WORLD_SIZE)."""
    import torch

    _, _, _, local_world = launch_env()
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if requested > 0:
        t = Threads(requested, "train.threads")
    elif omp.isdigit() and int(omp) > 0:
        t = Threads(int(omp), "OMP_NUM_THREADS; set train.threads to change")
    else:
        t = default_threads(local_world)
    torch.set_num_threads(t.n)  # torch's intra-op pool: OpenMP in this process
    os.environ["RAYON_NUM_THREADS"] = str(t.n)
    return t
