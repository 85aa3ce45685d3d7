"""How a stage runs its units (Where: data.executor, data.ray_address, its workers) and what every
unit's task gets (TaskPolicy, data.task.*: I/O retries, timeout, memory, Ray's in-flight limit),
from the data config. docs/ray.md has the details.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
from dataclasses import dataclass, field, replace

from codex.core import fsio, store
from codex.core.config import ConfigError
from codex.pipeline.executor.ray_cluster import check_ray_address, import_ray

log = logging.getLogger("codex.executor")


@dataclass(frozen=True)
class TaskPolicy:
    """What every unit's task gets (data.task.*; codex/core/config/data.py: TaskConfig)."""

    memory_bytes: int = 0  # Ray's memory= reservation per task; 0: none
    timeout_s: float = 0.0  # a unit running longer fails (UnitTimeout); 0: no limit
    io_retries: int = 4  # attempts more after a transient I/O error
    ray_pending: int = 16  # Ray: units queued beyond the cluster's CPUs, at least
    store_timeout_s: float = store.StoreSettings.timeout_s  # the driver's store_timeout_s
    # data.task.memory_gb_by_phase, timeout_s_by_phase: (phase, memory_bytes), (phase, timeout_s)
    memory_by_phase: tuple[tuple[str, int], ...] = ()
    timeout_by_phase: tuple[tuple[str, float], ...] = ()

    def for_phase(self, phase: str) -> TaskPolicy:
        """This policy with `phase`'s own memory and timeout, where it has them."""
        memory = dict(self.memory_by_phase).get(phase, self.memory_bytes)
        timeout = dict(self.timeout_by_phase).get(phase, self.timeout_s)
        if (memory, timeout) == (self.memory_bytes, self.timeout_s):
            return self
        return replace(self, memory_bytes=memory, timeout_s=timeout)


@dataclass(frozen=True)
class Where:
    """How a stage runs its units: `data.executor`, `data.ray_address`, the stage's workers, its
    tasks' policy (data.task.*) and where their log files go."""

    executor: str = "local"  # local | ray
    workers: int = 1
    ray_address: str = ""
    task: TaskPolicy = TaskPolicy()
    # the folder of the units' log files (RUN/logs); "": the driver's log file's, if it has one
    logs: str = ""
    # local workers > 1: the process pool every run_units call uses (stage_pool), else one per call
    pool: cf.ProcessPoolExecutor | None = field(default=None, compare=False, repr=False)
    # ... and its first tasks, one a process: done once every process has started (and warmed)
    started: tuple[cf.Future, ...] = field(default=(), compare=False, repr=False)

    @property
    def parallel(self) -> bool:
        """Whether units run side by side (Ray, or more than one local process)."""
        return self.executor == "ray" or self.workers > 1


def cores() -> int:
    """The cores this process may run on (its affinity, e.g. under taskset or a container)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def auto_workers(input_bytes: int, bytes_per_worker: int) -> int:
    """What --workers 0 (the default) means for input_bytes of input: one process per core, and
    one per bytes_per_worker at most (below that a process's start, spawn and imports, costs
    more than its share of the work gains; each stage measured its own: README's stage table)."""
    return max(1, min(cores(), input_bytes // bytes_per_worker))


def check_executor(data_cfg) -> None:
    """data.executor is local or ray, Ray is installed for ray and something answers at the
    cluster's address: a stage asks before it reads or touches any file."""
    if data_cfg.executor not in ("local", "ray"):
        raise ConfigError(f"data.executor must be local or ray, got {data_cfg.executor!r}")
    if data_cfg.executor == "ray":
        import_ray()
        check_ray_address(data_cfg.ray_address)


def where_for(
    data_cfg, workers: int, input_bytes: int = 0, bytes_per_worker: int = 1, run: str = ""
) -> Where:
    """The Where of a stage from the data config (data.executor, data.ray_address, data.task);
    workers 0 is auto_workers(input_bytes, bytes_per_worker) (a Ray runtime started here: every
    core); local processes are as many as data.task.memory_gb lets fit in this machine's memory.
    The units' log files go under RUN/logs (`run`), else beside the driver's log file."""
    check_executor(data_cfg)
    if workers < 0:
        raise ConfigError(
            f"workers must be >= 0 (0: one per core, as the input allows), got {workers}"
        )
    if workers == 0:
        workers = (
            cores() if data_cfg.executor == "ray" else auto_workers(input_bytes, bytes_per_worker)
        )
        log.info(
            "--workers 0: %d worker(s) for %.1f MB of input on %d core(s)",
            workers,
            input_bytes / 1e6,
            cores(),
        )
    task = task_policy(getattr(data_cfg, "task", None))
    if data_cfg.executor == "local" and task.memory_bytes:
        fit = max(1, machine_memory() // task.memory_bytes)
        if workers > fit:
            log.warning(
                "data.task.memory_gb=%g: %d worker(s) fit in this machine's %.1f GB, not %d",
                task.memory_bytes / 1e9,
                fit,
                machine_memory() / 1e9,
                workers,
            )
            workers = fit
    return Where(
        data_cfg.executor,
        workers,
        data_cfg.ray_address,
        task,
        fsio.join(run, "logs") if run else "",
    )


def task_policy(task_cfg) -> TaskPolicy:
    """The TaskPolicy of data.task (TaskConfig; None: the defaults) and of this process's object
    store settings (store_timeout_s: the command set them)."""
    if task_cfg is None:
        return TaskPolicy(store_timeout_s=store.SETTINGS.timeout_s)
    memory = _by_phase("data.task.memory_gb_by_phase", task_cfg.memory_gb_by_phase)
    timeouts = _by_phase("data.task.timeout_s_by_phase", task_cfg.timeout_s_by_phase)
    return TaskPolicy(
        memory_bytes=int(task_cfg.memory_gb * 1e9),
        timeout_s=float(task_cfg.timeout_s),
        io_retries=int(task_cfg.io_retries),
        ray_pending=int(task_cfg.ray_pending),
        store_timeout_s=store.SETTINGS.timeout_s,
        memory_by_phase=tuple((k, int(v * 1e9)) for k, v in memory),
        timeout_by_phase=tuple(timeouts),
    )


def _by_phase(key: str, items: list[str]) -> list[tuple[str, float]]:
    """PHASE=NUMBER items as (phase, number); a ConfigError naming the key and the item for
    one that is not."""
    got = []
    for item in items:
        phase, _, value = str(item).partition("=")
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not phase.strip().isidentifier() or number < 0:
            raise ConfigError(
                f"{key}: {item!r} is not PHASE=NUMBER (a unit function's name and a number "
                ">= 0), e.g. clean_unit=4"
            )
        got.append((phase.strip(), number))
    return got


def machine_memory() -> int:
    """Bytes of memory this process's machine (or its container's cgroup limit) has."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                total = min(total, int(f.read().strip()))
    return total


def in_flight_limit(cpus: int, pending: int) -> int:
    """How many units the driver keeps submitted to a cluster of `cpus` CPUs: one running on
    each, and as many queued (so every worker has its next unit), but at least `pending` queued:
    an autoscaler adds nodes for the demand it sees queued, and a cluster whose workers scale up
    from zero (a 0-CPU head) would otherwise see almost none."""
    return max(1, cpus + max(cpus, pending))
