"""Where a data stage's units of work run: this process, a local process pool, or a Ray cluster.

    run_units(fn, units, where, progress)   yields (unit, fn(unit)) as units finish, any order
    slots(where)                            how many units run side by side (workers, Ray CPUs)
    stage_pool(where, warm)                 one local pool for all of a stage's run_units calls

policy.py (Where, TaskPolicy, --workers 0), task.py (a unit's task), logs.py (its log file),
local.py (this process and a pool), ray_cluster.py (the driver's attachment), ray_tasks.py (units
as Ray tasks). docs/ray.md explains the contract. Imports codex/ only; no stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from codex.core.progress import Progress
from codex.pipeline.executor import ray_cluster
from codex.pipeline.executor.local import new_pool, run_in_order, run_pool
from codex.pipeline.executor.logs import worker_id
from codex.pipeline.executor.policy import (
    TaskPolicy,
    Where,
    auto_workers,
    check_executor,
    cores,
    where_for,
)
from codex.pipeline.executor.ray_tasks import run_ray
from codex.pipeline.executor.task import UnitTimeout, task_specs

# what the stages import: the entries below and these
__all__ = [
    "TaskPolicy",
    "UnitTimeout",
    "Where",
    "auto_workers",
    "check_executor",
    "cores",
    "run_units",
    "slots",
    "stage_pool",
    "where_for",
    "worker_id",
]

U = TypeVar("U")


def slots(where: Where) -> int:
    """How many units run side by side: the local workers, or the Ray cluster's CPUs (a stage
    may cut its work into more units when it has fewer than this)."""
    if where.executor != "ray":
        return where.workers
    try:
        ray = ray_cluster.connect_ray(where.ray_address, where.workers)
        return max(1, int(ray.cluster_resources().get("CPU", 1)))
    finally:
        ray_cluster.detach_outside_stage()  # not inside a stage (stage_pool): detach now


def run_units(
    fn: Callable[[U], Any],
    units: Sequence[U],
    where: Where,
    progress: Progress | None = None,
    count: Callable[[U, Any], dict[str, float]] | None = None,
) -> Iterator[tuple[U, Any]]:
    """Run fn on every unit, each as a task (task.run_task: where.task's retries of transient I/O
    errors and of a unit past its timeout, a log file of its own); yield (unit, result) as each
    finishes, in any order. A unit that fails for good stops no other: every unit runs (and is
    yielded), then the first failure's exception is raised here, one error line naming the
    failed units logged first (an exception raised by fn that is not transient is not retried:
    bad input fails the same way twice; Ray retries a task whose worker died). Per finished
    unit: progress.update(1, **count(unit, result)), e.g. the bytes and documents it read."""
    if not units:
        return
    tasks = task_specs(fn, units, where)
    if where.executor == "ray":
        runner = run_ray(tasks, units, where)
    elif where.workers == 1 or len(units) == 1:
        runner = run_in_order(tasks, units)
    else:
        runner = run_pool(tasks, units, where)
    try:
        for unit, result in runner:
            if progress is not None:
                progress.update(1, **(count(unit, result) if count else {}))
            yield unit, result
    finally:
        # a caller that stops early (it raised) stops the units now, not when this is collected
        runner.close()
        if where.executor == "ray":  # not inside a stage (stage_pool): detach
            ray_cluster.detach_outside_stage()


@contextlib.contextmanager
def stage_pool(where: Where, warm: Callable[[], Any] | None = None) -> Iterator[Where]:
    """A Where whose run_units calls share one pool of `where.workers - 1` local processes (this
    one is the N-th), started now (each runs `warm`, e.g. loading what its units need, while the
    driver goes on) and closed on exit: a stage of several phases spawns its workers once, not
    once per phase. Ray and workers=1: `where` itself; for Ray, the driver attached by the
    stage's first unit stays attached until the stage ends, then detaches (detach_ray)."""
    if where.executor == "ray":
        with ray_cluster.attached_for_stage():
            yield where
        return
    if where.workers == 1:
        yield where
        return
    pool, up = new_pool(where.workers - 1, warm)
    with pool:
        yield replace(where, pool=pool, started=up)
