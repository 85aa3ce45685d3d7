"""A unit's task: what runs it (Task), how it runs in whichever process takes it (run_task: its
I/O retries, its timeout, its log file) and the one error line for the units that failed for good
(Failures, report_failures). docs/ray.md has the details.
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


class TaskSpecs(Sequence[Task]):
    """Every unit's Task (its phase: fn's name; its name; where.task with the phase's own memory
    and timeout; its log file's path), made when asked for: a run of a million units holds no
    million Tasks."""

    def __init__(self, fn, units: Sequence, where: Where):
        self.fn, self.units = fn, units
        self.logs = where.logs or (os.path.dirname(log_file() or "") if log_file() else "")
        inner = fn
        while isinstance(inner, functools.partial):
            inner = inner.func
        self.phase = getattr(inner, "__name__", "unit")
        self.policy = where.task.for_phase(self.phase)  # its memory and timeout

    def __len__(self) -> int:
        return len(self.units)

    def __iter__(self) -> Iterator[Task]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        name = unit_name(self.units[i], i)
        # on an object store, a hash of the name first (fsio.spread): logs written at once spread
        path = fsio.join(self.logs, self.phase, f"{fsio.spread(self.logs, name)}.log")
        path = path if self.logs else ""
        return Task(self.fn, self.phase, name, self.policy, path)


def task_specs(fn, units: Sequence, where: Where) -> TaskSpecs:
    """Every unit's Task, made as each is asked for (TaskSpecs)."""
    return TaskSpecs(fn, units, where)


def run_task(task: Task, unit):
    """task.fn(unit) in the process that runs the unit (this one, a pool process, a Ray worker),
    its log lines in its own file, run again after a transient I/O error (a unit is idempotent),
    stopped past its timeout and run again, data.task.io_retries times in all for each (a stalled
    read, a node swapping: the next attempt usually passes). Its object-store requests get the
    driver's bound and retries."""
    bound = store.configured(task.policy.store_timeout_s, task.policy.io_retries)
    what = f"{task.phase} {task.name}"
    with bound, unit_log(what, task.log_path):
        attempt = 0
        while True:
            try:
                with _deadline(task, attempt):
                    return fsio.with_retries(
                        lambda: task.fn(unit), what, attempts=task.policy.io_retries + 1
                    )
            except Exception as e:
                attempt += 1
                if attempt > task.policy.io_retries or not timed_out(e):
                    raise
                log.warning(
                    "%s: ran past data.task.timeout_s=%gs and was stopped; run again (%d/%d)",
                    what,
                    task.policy.timeout_s,
                    attempt,
                    task.policy.io_retries,
                )


def timed_out(e: BaseException) -> bool:
    """Whether e is a unit's UnitTimeout, or raised from one (a library that wraps what
    interrupted it)."""
    cause: BaseException | None = e
    for _ in range(8):
        if cause is None or isinstance(cause, UnitTimeout):
            return cause is not None
        cause = cause.__cause__ or cause.__context__
    return False


@contextlib.contextmanager
def _deadline(task: Task, attempt: int = 0) -> Iterator[None]:
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
            f"stopped (attempt {attempt + 1} of {task.policy.io_retries + 1}); raise the limit, "
            "or look at that unit's input"
        )

    before = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


class Failures:
    """The units of a run that failed for good: every one's task, and the first one's exception
    (a run whose every unit fails, a bug say, holds one traceback, not one a unit)."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self.first: BaseException | None = None

    def add(self, task: Task, e: BaseException) -> None:
        self.tasks.append(task)
        if self.first is None:
            self.first = e

    def __bool__(self) -> bool:
        return bool(self.tasks)


def report_failures(failed: Failures, units: int) -> BaseException:
    """The exception to raise for the units that failed for good (the first one's), after one
    error line naming them (up to 5) out of the run's `units`: the others all ran (a failure
    stops no unit), so a rerun runs only these."""
    task, first = failed.tasks[0], failed.first
    assert first is not None
    names = ", ".join(t.name for t in failed.tasks[:5]) + (" ..." if len(failed.tasks) > 5 else "")
    log.error(
        "%s: %d of %d unit(s) failed: %s (%s: %s); the other %d finished; a rerun runs only the "
        "units without a marker%s",
        task.phase,
        len(failed.tasks),
        units,
        names,
        type(first).__name__,
        str(first).strip().splitlines()[0] if str(first).strip() else "",
        units - len(failed.tasks),
        f" (the first one's log: {task.log_path})" if task.log_path else "",
    )
    with contextlib.suppress(Exception):
        first.add_note(f"in {task.phase} unit {task.name}")
    return first
