"""A unit's task: what runs it (Task), how it runs in whichever process takes it (run_task: its
I/O retries, its timeout, its log file) and the one error line for the units that failed for good
(report_failures). docs/ray.md has the details.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from codex.core import fsio, store
from codex.core.progress import log_file
from codex.pipeline.executor.logs import unit_log
from codex.pipeline.executor.policy import TaskPolicy, Where

log = logging.getLogger("codex.executor")


class UnitTimeout(RuntimeError):
    """A unit ran past data.task.timeout_s (not a TimeoutError: that one is retried)."""


@dataclass(frozen=True)
class Task:
    """One unit's task: what runs it and how (sent with the unit to the process that runs it)."""

    fn: Callable[[Any], Any]
    phase: str  # fn's name (clean_unit, dedup_partition, ...): the folder of its units' logs
    name: str  # the unit's name, for messages and its log file
    policy: TaskPolicy
    log_path: str  # "": no log file of its own


def unit_name(unit: Any, position: int) -> str:
    """A unit's name in messages and its log file's name: its `name` (clean's units, through
    their job's `unit`), `index` (dedup's partitions, shard's parts), split and first shard,
    file name and first row, the unit itself (a number, a path's file name); else its position
    in the stage's list. Only [A-Za-z0-9._@-] in it."""
    if isinstance(unit, (int, str)) and not isinstance(unit, bool):
        return (
            re.sub(r"[^A-Za-z0-9._@-]", "_", fsio.basename(str(unit)))[-100:] or f"{position:06d}"
        )
    for get in (
        lambda u: u.name,
        lambda u: u.unit.name,
        lambda u: f"{u.index:06d}",
        lambda u: f"{u.split}-{u.first:06d}",
        lambda u: fsio.basename(u.path) + (f"@{u.start}" if getattr(u, "start", 0) else ""),
    ):
        try:
            name = get(unit)
        except (AttributeError, TypeError, ValueError):
            continue
        if isinstance(name, str) and name:
            break
    else:
        name = f"{position:06d}"
    return re.sub(r"[^A-Za-z0-9._@-]", "_", name)[-100:]


def task_specs(fn, units: Sequence, where: Where) -> list[Task]:
    """Every unit's Task: its phase (fn's name), its name, where.task and its log file's path."""
    logs = where.logs or (os.path.dirname(log_file() or "") if log_file() else "")
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    phase = getattr(inner, "__name__", "unit")
    tasks = []
    for i, unit in enumerate(units):
        name = unit_name(unit, i)
        path = fsio.join(logs, phase, f"{name}.log") if logs else ""
        tasks.append(Task(fn, phase, name, where.task, path))
    return tasks


def run_task(task: Task, unit):
    """task.fn(unit) in the process that runs the unit (this one, a pool process, a Ray worker),
    its log lines in its own file, run again after a transient I/O error (a unit is idempotent),
    stopped past its timeout. Its object-store requests get the driver's bound and retries."""
    bound = store.configured(task.policy.store_timeout_s, task.policy.io_retries)
    with bound, unit_log(f"{task.phase} {task.name}", task.log_path), _deadline(task):
        return fsio.with_retries(
            lambda: task.fn(unit),
            f"{task.phase} {task.name}",
            attempts=task.policy.io_retries + 1,
        )


@contextlib.contextmanager
def _deadline(task: Task) -> Iterator[None]:
    """UnitTimeout raised in the unit once task.policy.timeout_s has passed (SIGALRM: Python
    code, and a blocking read or sleep, is interrupted; a call inside a C library that does not
    return to Python is interrupted when it does). Only on a process's main thread, where units
    run (this process, a pool process, a Ray worker); elsewhere the unit runs without."""
    seconds = task.policy.timeout_s
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(_signum, _frame):
        raise UnitTimeout(
            f"{task.phase} {task.name} ran past data.task.timeout_s={seconds:g}s and was "
            "stopped; raise the limit, or look at that unit's input"
        )

    before = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def report_failures(failed: list[tuple[Task, BaseException]], finished: int) -> BaseException:
    """The exception to raise for the units that failed for good (the first one's), after one
    error line naming them."""
    task, first = failed[0]
    names = ", ".join(t.name for t, _ in failed[:5]) + (" ..." if len(failed) > 5 else "")
    log.error(
        "%s: unit%s %s failed (%s: %s)%s; a rerun runs only the units without a marker%s",
        task.phase,
        "s" if len(failed) > 1 else "",
        names,
        type(first).__name__,
        str(first).strip().splitlines()[0] if str(first).strip() else "",
        f"; the {finished} other unit(s) in flight finished first" if finished else "",
        f" (its log: {task.log_path})" if task.log_path else "",
    )
    with contextlib.suppress(Exception):
        first.add_note(f"in {task.phase} unit {task.name}")
    return first
