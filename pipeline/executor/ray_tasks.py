"""Units as Ray tasks: one task per unit (1 CPU, retried up to RAY_MAX_RETRIES times when its
worker dies), as many in flight as the cluster's CPUs allow, read again as nodes join and leave
(_Limit), each learnt of as it finishes from its future (_Finished: the driver's cost per unit
does not grow with the tasks in flight). docs/ray.md has the details.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from codex.pipeline.executor.policy import Where, in_flight_limit
from codex.pipeline.executor.ray_cluster import (
    HeadWatch,
    RayClusterLost,
    connect_ray,
    head_watch,
)
from codex.pipeline.executor.task import Failures, Task, report_failures, run_task

log = logging.getLogger("codex.executor")

RAY_MAX_RETRIES = 3  # Ray's default for tasks; a unit is idempotent, so a retry is safe
# how often the driver reads the cluster's CPUs again while units run (nodes join and leave)
RAY_RESOURCES_S = 2.0
# finished tasks the driver hands on before it submits more (and reads the cluster's CPUs again)
TAKE_MOST = 256


def _ray_task(task: Task, unit):
    """A Ray task: the unit's task on its one CPU. Ray sets OMP_NUM_THREADS to the task's CPUs;
    the encoder's thread pool (rayon, built on first use in the worker) is held to one thread
    too."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return run_task(task, unit)


class _Limit:
    """The in-flight limit of a Ray run, from the cluster's CPUs read again every
    RAY_RESOURCES_S while units run: it rises as nodes join and falls as they leave (a unit
    already submitted stays). Each change is logged ("ray: N CPUs ...")."""

    def __init__(self, ray, pending: int, watch: HeadWatch):
        self.ray, self.pending, self.watch = ray, pending, watch
        self.value = 0
        self.read_at = -math.inf
        self.read()

    def read(self) -> int:
        if time.monotonic() - self.read_at < RAY_RESOURCES_S:
            return self.value
        self.read_at = time.monotonic()
        # asked of the head: while it does not answer, the last value stands (and the watch
        # ends the stage once it has not answered for RAY_LOST_S)
        if self.value and not self.watch.check(now=True):
            return self.value
        cpus = int(self.ray.cluster_resources().get("CPU", 0))
        value = in_flight_limit(cpus, self.pending)
        if value != self.value:
            log.info("ray: %d CPUs in the cluster: up to %d units in flight", cpus, value)
            self.value = value
        return value


class _Finished:
    """The driver's view of its tasks finishing: each task's future (ObjectRef.future()) calls
    back, on Ray's thread, into a queue the driver reads. So the driver's cost per finished unit
    is the same with 1,000 tasks in flight or 64,000: a ray.wait over every ref in flight would
    cost it O(in flight) per unit (docs/ray.md has the numbers). bench/bench_ray_driver.py puts
    such a ray.wait in its place (the same ray, watch, add and take) to compare them."""

    def __init__(self, ray, watch: HeadWatch):
        self.watch = watch
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def add(self, ref) -> None:
        ref.future().add_done_callback(lambda fut: self.queue.put((ref, fut.result)))

    def take(self, running: dict, timeout: float) -> list[tuple[Any, Callable[[], Any]]]:
        """(ref, its result's getter) of tasks that finished: those there now, waiting up to
        `timeout` for the first (the head checked every second meanwhile, and after)."""
        got: list[tuple[Any, Callable[[], Any]]] = []
        deadline = time.monotonic() + timeout
        while not got:
            try:
                got.append(self.queue.get(timeout=min(1.0, max(0.0, deadline - time.monotonic()))))
            except queue.Empty:
                pass
            self.watch.check()
            if time.monotonic() >= deadline:
                break
        while len(got) < TAKE_MOST:
            try:
                got.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return got


def run_ray(tasks: list[Task], units: Sequence, where: Where) -> Generator[tuple[Any, Any]]:
    """Every unit's task as a Ray task (1 CPU, retried when its worker dies), a bounded number in
    flight; yields (unit, result) as each finishes. A unit that fails for good stops no other:
    every unit runs, then the first failure's exception is raised (report_failures)."""
    ray = connect_ray(where.ray_address, where.workers)
    watch = head_watch(ray, where.ray_address)
    # SPREAD: units go to every node from the start, rather than packing onto the first node until
    # it is saturated (short units could all finish there before another node starts a worker)
    options: dict[str, Any] = {
        "num_cpus": 1,
        "max_retries": RAY_MAX_RETRIES,
        "retry_exceptions": False,
        "scheduling_strategy": "SPREAD",
    }
    if where.task.memory_bytes:
        options["memory"] = where.task.memory_bytes
    remote = ray.remote(**options)(_ray_task)
    named = remote.options(name=tasks[0].phase)  # `ray::clean_unit` in ps and Ray's state API
    # A bounded number in flight (_Limit): the driver holds refs, not results, and a huge plan
    # does not flood the scheduler
    limit = _Limit(ray, where.task.ray_pending, watch)
    finished = _Finished(ray, watch)
    todo = list(zip(tasks, units, strict=True))
    todo.reverse()
    running: dict[Any, tuple[Task, Any]] = {}
    failed = Failures()
    try:
        while todo or running:
            while todo and len(running) < limit.read():
                task, u = todo.pop()
                ref = named.remote(task, u)
                running[ref] = (task, u)
                finished.add(ref)
            for ref, get in finished.take(running, RAY_RESOURCES_S):
                task, u = running.pop(ref)
                try:
                    result = get()
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    failed.add(task, cause if isinstance(cause, BaseException) else e)
                    continue
                except ray.exceptions.RayError as e:  # its worker died RAY_MAX_RETRIES + 1 times
                    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    failed.add(task, UnitFailed(f"{task.phase} {task.name}: {why}"))
                    continue
                yield u, result
    except RayClusterLost:
        raise  # nothing left to cancel them
    except BaseException:
        for ref in running:
            ray.cancel(ref, force=True)
        raise
    if failed:
        raise report_failures(failed, len(tasks))


class UnitFailed(RuntimeError):
    """A unit's Ray task failed without an exception of its own (its worker died, every retry)."""
