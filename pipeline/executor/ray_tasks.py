"""Units as Ray tasks: a unit a task (1 CPU, retried up to RAY_MAX_RETRIES times when its worker
dies), or several when units are many and short (_Batches: Ray's own cost a task, ~1 ms of the
driver's CPU, shared by the units of a batch), as many tasks in flight as the cluster's CPUs allow,
read again as nodes join and leave (_Limit), each learnt of as it finishes from its future
(_Finished: the driver's cost a unit does not grow with the tasks in flight). docs/ray.md has the
details.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import queue
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from codex.pipeline.executor.policy import TaskPolicy, Where, in_flight_limit
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
# Batches: a task's units are at most MAX_BATCH, FIRST_BATCH before any unit's time is known, and
# hold about TASK_CPU_S of CPU (units of that or more: one a task); never so many that a task slot
# would get fewer than SHARES tasks of what is left (the tail's tasks shrink to one unit)
MAX_BATCH = 64
FIRST_BATCH = 8
TASK_CPU_S = 0.05
SHARES = 2


def _ray_task(batch: list[tuple[Task, Any]]) -> list[tuple[bool, Any, float]]:
    """A Ray task: each unit's task in turn on its one CPU; per unit (ok, its result or its
    exception, its CPU seconds). A unit that fails for good fails alone: the batch's other units
    still run. Ray sets OMP_NUM_THREADS to the task's CPUs; the encoder's thread pool (rayon,
    built on first use in the worker) is held to one thread too."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    out: list[tuple[bool, Any, float]] = []
    for task, unit in batch:
        t0 = time.process_time()
        try:
            result: tuple[bool, Any] = (True, run_task(task, unit))
        except Exception as e:
            result = (False, _sendable(e, task))
        out.append((*result, time.process_time() - t0))
    return out


def _sendable(e: Exception, task: Task) -> Exception:
    """e, or, when it does not survive pickling (the trip back to the driver), a UnitFailed
    with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return UnitFailed(f"{task.phase} {task.name}: {type(e).__name__}: {line}")


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


class _Batches:
    """The units not started yet, handed out a batch a task: as many as hold TASK_CPU_S of CPU
    by the units' mean so far (FIRST_BATCH before the first is known), at most MAX_BATCH, and at
    most what is left over SHARES x the tasks in flight (so the last tasks are single units and
    the slots run out of work together). A batch whose worker died every retry comes back as
    single units (alone): only the unit that kills its worker fails."""

    def __init__(self, tasks: Sequence[Task], units: Sequence):
        self.tasks, self.units = tasks, units
        self.next = 0  # the first unit not handed out yet
        self.alone: list[tuple[Task, Any]] = []  # units to run a task each
        self.cpu_s = 0.0  # CPU seconds of the units finished ...
        self.timed = 0  # ... and how many

    def __bool__(self) -> bool:
        return bool(self.alone) or self.next < len(self.units)

    def size(self, limit: int) -> int:
        if self.timed:
            mean = self.cpu_s / self.timed
            by_time = MAX_BATCH if mean <= 0 else max(1, int(TASK_CPU_S / mean))
        else:
            by_time = FIRST_BATCH
        share = (len(self.units) - self.next) // (SHARES * max(1, limit))
        return max(1, min(MAX_BATCH, by_time, share))

    def take(self, limit: int) -> list[tuple[Task, Any]]:
        if self.alone:
            return [self.alone.pop()]
        n = self.size(limit)
        batch = [(self.tasks[i], self.units[i]) for i in range(self.next, self.next + n)]
        self.next += n
        return batch

    def timed_unit(self, cpu_s: float) -> None:
        self.cpu_s += cpu_s
        self.timed += 1


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


def _remote(ray, policy: TaskPolicy, phase: str):
    """The Ray remote function of the run's tasks: 1 CPU, the phase's memory reservation,
    retried when its worker dies, named after the phase (`ray::clean_unit` in ps and Ray's
    state API). SPREAD: units go to every node from the start, rather than packing onto the
    first node until it is saturated (short units could all finish there before another node
    starts a worker)."""
    options: dict[str, Any] = {
        "num_cpus": 1,
        "max_retries": RAY_MAX_RETRIES,
        "retry_exceptions": False,
        "scheduling_strategy": "SPREAD",
    }
    if policy.memory_bytes:
        options["memory"] = policy.memory_bytes
    return ray.remote(**options)(_ray_task).options(name=phase)


def run_ray(tasks: Sequence[Task], units: Sequence, where: Where) -> Generator[tuple[Any, Any]]:
    """Every unit's task on Ray (_ray_task: a unit or a batch of them a task, 1 CPU, retried when
    its worker dies), a bounded number of tasks in flight; yields (unit, result) as each
    finishes. A unit that fails for good stops no other: every unit runs, then the first
    failure's exception is raised (report_failures)."""
    ray = connect_ray(where.ray_address, where.workers)
    watch = head_watch(ray, where.ray_address)
    named = _remote(ray, tasks[0].policy, tasks[0].phase)
    # A bounded number in flight (_Limit): the driver holds refs, not results, and a huge plan
    # does not flood the scheduler
    limit = _Limit(ray, where.task.ray_pending, watch)
    finished = _Finished(ray, watch)
    todo = _Batches(tasks, units)
    running: dict[Any, list[tuple[Task, Any]]] = {}
    failed = Failures()
    try:
        while todo or running:
            while todo and len(running) < limit.read():
                batch = todo.take(limit.value)
                ref = named.remote(batch)
                running[ref] = batch
                finished.add(ref)
            for ref, get in finished.take(running, RAY_RESOURCES_S):
                batch = running.pop(ref)
                try:
                    results = get()
                except ray.exceptions.RayError as e:  # its worker died RAY_MAX_RETRIES + 1 times
                    if len(batch) > 1:  # again a unit a task: only the unit that kills it fails
                        todo.alone += batch
                        continue
                    task = batch[0][0]
                    cause = getattr(e, "cause", None)
                    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(
                        cause, BaseException
                    ):
                        failed.add(task, cause)
                        continue
                    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    failed.add(task, UnitFailed(f"{task.phase} {task.name}: {why}"))
                    continue
                for (task, u), (ok, result, cpu_s) in zip(batch, results, strict=True):
                    todo.timed_unit(cpu_s)
                    if ok:
                        yield u, result
                    else:
                        failed.add(task, result)
    except RayClusterLost:
        raise  # nothing left to cancel them
    except BaseException:
        for ref in running:
            ray.cancel(ref, force=True)
        raise
    if failed:
        raise report_failures(failed, len(units))


class UnitFailed(RuntimeError):
    """A unit's Ray task failed without an exception of its own (its worker died, every retry)."""
