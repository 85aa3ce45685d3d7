"""Units on this machine: in this process, in order (run_in_order), or in this process and a pool
of spawned ones fed one unit at a time (new_pool, run_pool). docs/ray.md has the details.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import contextlib
import functools
import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from codex.core.progress import setup_logging
from codex.pipeline.executor.policy import Where
from codex.pipeline.executor.task import Failures, Task, report_failures, run_task

log = logging.getLogger("codex.executor")

# how long a started pool process waits for its siblings before it takes units anyway
POOL_START_S = 120.0


def run_in_order(tasks: Sequence[Task], units: Sequence) -> Generator[tuple[Any, Any]]:
    """Every unit in this process, in order; one that fails stops no other: the run raises the
    first failure's exception once every unit has run (report_failures)."""
    failed = Failures()
    for task, unit in zip(tasks, units, strict=True):
        try:
            result = _here(run_task, task, unit)
        except Exception as e:
            failed.add(task, e)
            continue
        yield unit, result
    if failed:
        raise report_failures(failed, len(tasks))


def _start_process(parent: int, warm: Callable[[], Any] | None, up: threading.Barrier) -> None:
    """A pool process's start, before its first task: exit when its driver is gone (no orphan
    writing on), load what its units need (`warm`), then wait for the pool's other processes at
    `up`. So the pool's first task is done only once every process is up and warm: the driver
    then feeds one unit each, and none waits queued behind a sibling's."""
    setup_logging()
    threading.Thread(target=_exit_without, args=(parent,), daemon=True).start()
    atexit.register(_exit_at_shutdown)
    if warm is not None:
        try:
            warm()
        except Exception:  # the first unit that needs it fails the same way, saying why
            log.debug("pool process %d: warm failed", os.getpid(), exc_info=True)
    try:
        up.wait(POOL_START_S)
    except threading.BrokenBarrierError:  # a sibling died starting: the pool reports it broken
        pass


def _exit_at_shutdown() -> None:
    """A pool process's exit, once the pool has shut it down: flush the logs and leave without the
    interpreter's teardown of every module and object, which the driver would wait for at the end
    of its stage (~50 ms, serial). It holds no open output: a unit writes and renames its files
    before its result is sent (synchronously, on the pool's result pipe). atexit runs the last
    registered hook first: those registered before this one (logging's, multiprocessing's, ones
    made at import) are skipped, those a unit registers still run. The exit status is 0; the pool
    notices a process that died by its sentinel, not its status."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_without(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


def new_pool(processes: int, warm: Callable[[], Any] | None = None):
    """A pool of `processes` spawned processes (fork is unsafe with gcsfs' threads), all started
    now, and its first tasks: done once every process is up (_start_process)."""
    ctx = mp.get_context("spawn")
    pool = cf.ProcessPoolExecutor(
        processes,
        ctx,
        initializer=_start_process,
        initargs=(os.getpid(), warm, ctx.Barrier(processes)),
    )
    # one task a process: the pool spawns a process for each task it cannot hand to an idle one
    return pool, tuple(pool.submit(_nothing) for _ in range(processes))


def _nothing() -> None:
    pass


class _Feed:
    """The units of one run_pool call, shared by the driver's loop and the pool's thread (its
    done-callbacks) under one lock: each pool process is fed one unit once it has started, and the
    next as it finishes one, so no process waits on the driver."""

    def __init__(self, pool: cf.ProcessPoolExecutor, todo: collections.deque):
        self.pool = pool
        self.todo = todo  # (task, unit) not started yet, in the list's order
        self.running: dict[cf.Future, tuple[Task, Any]] = {}  # in the pool: future -> (task, unit)
        self.finished: queue.SimpleQueue = queue.SimpleQueue()  # futures the pool has finished
        self.broken: list[BaseException] = []  # the pool could take no unit (a process died)
        self.failed = Failures()  # units that failed for good
        self.units = len(todo)
        self.lock = threading.Lock()  # todo, running and broken, shared with the pool's thread

    def feed(self, _started: cf.Future | None = None) -> None:
        """Hand the pool the next unit (a done-callback: of a process's start, of a unit)."""
        with self.lock:
            if not self.todo:
                return
            task, unit = self.todo.popleft()
            try:
                fut = self.pool.submit(run_task, task, unit)
            except Exception as e:  # broken, shut down: raised by the loop, unit kept
                self.todo.appendleft((task, unit))
                self.broken.append(e)
                return
            self.running[fut] = (task, unit)
        fut.add_done_callback(self._next_unit)

    def _next_unit(self, done: cf.Future) -> None:
        self.finished.put(done)
        if not done.cancelled():
            self.feed()

    def outcome(self, task: Task, unit, get: Callable[[], Any]) -> Iterator[tuple[Any, Any]]:
        """(unit, get()) once, or nothing when get raises: the unit failed for good (the others
        go on; the run raises at its end)."""
        try:
            result = get()
        except Exception as e:
            self.failed.add(task, e)
            return
        yield unit, result

    def pool_finished(self) -> Iterator[tuple[Task, Any, cf.Future]]:
        """(task, unit, future) of each unit the pool finished since the last call."""
        while not self.finished.empty():
            fut = self.finished.get()
            with self.lock:
                task, unit = self.running.pop(fut)
            yield task, unit, fut

    def next_here(self) -> tuple[tuple[Task, Any] | None, bool]:
        """The next unit for this process (None: none left) and whether the pool runs any; the
        pool's error once it could take no unit and has none left running."""
        with self.lock:
            if self.broken and not self.running:
                raise self.broken[0]
            return (self.todo.popleft() if self.todo else None), bool(self.running)

    def cancel(self) -> None:
        """No new unit; those fed to the pool are cancelled where they have not started."""
        with self.lock:
            self.todo.clear()
            left = list(self.running)
        # not under the lock: cancel runs the done-callbacks here. A unit fed to the pool is
        # already running there (queued counts as running), so this rarely cancels one: the
        # pool's exit waits for them, and their results are dropped
        for fut in left:
            fut.cancel()


def run_pool(tasks: Sequence[Task], units: Sequence, where: Where) -> Generator[tuple[Any, Any]]:
    """Every unit's task, on where.workers processes: this one and a pool of the others (the
    stage's, else one for this call). The pool's processes are fed by _Feed; this process runs
    units too, handing on what the pool finished in between, then waits for the pool's last.
    Every process takes the next unit from the front of the list, so units start in the list's
    order (a stage puts its small units last: the processes run out of work together). So this
    process works from the start (while the others spawn and import), a phase shorter than a
    pool's start runs here whole, and no unit waits queued in the pool while a process idles at
    the end. A unit that fails stops no other: every unit runs, and the first failure's
    exception is raised at the end (report_failures)."""
    n = min(where.workers, len(units))
    pool, started = (where.pool, where.started) if where.pool else new_pool(n - 1)
    with contextlib.nullcontext(pool) if where.pool else pool:
        feed = _Feed(pool, collections.deque(zip(tasks, units, strict=True)))
        try:
            for first in started[: n - 1]:
                first.add_done_callback(feed.feed)
            yield from _drive(feed)
        except BaseException:
            feed.cancel()
            raise


def _drive(feed: _Feed) -> Generator[tuple[Any, Any]]:
    """run_pool's loop in this process: yield what the pool finished, run the next unit here,
    or wait for the pool; at the end, the first failure's exception."""
    while True:
        for task, unit, fut in feed.pool_finished():
            # the future is popped: the driver holds no result it has already handed on
            yield from feed.outcome(task, unit, fut.result)
        item, waiting = feed.next_here()
        if item is not None:
            task, unit = item
            yield from feed.outcome(task, unit, functools.partial(_here, run_task, task, unit))
        elif not waiting:
            if feed.failed:
                raise report_failures(feed.failed, feed.units)
            return
        else:
            feed.finished.put(feed.finished.get())  # block until the pool finishes one


def _here(fn, *args):
    """fn(*args) in this process, its environment as it was after (a unit may set its threads,
    e.g. shard's RAYON_NUM_THREADS, for the process it runs in; this one goes on after the
    stage)."""
    env = dict(os.environ)
    try:
        return fn(*args)
    finally:
        for key in os.environ.keys() - env.keys():
            del os.environ[key]
        for key, value in env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
