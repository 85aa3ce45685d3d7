"""Where a data stage's units of work run: this process, a local process pool, or a Ray cluster.

    run_units(fn, units, where, progress)   yields (unit, fn(unit)) as units finish, any order
    slots(where)                            how many units run side by side (workers, Ray CPUs)
    stage_pool(where, warm)                 one local pool for all of a stage's run_units calls

The stages own what a unit is (a byte range of an input file, rows of a cleaned part, a partition
of hashes) and make every unit idempotent: it writes through temp + rename and its marker last, and
removes what an earlier attempt left. So the same units give the same bytes whoever runs them, a
unit Ray retries after its worker died leaves no partial file, and a rerun after the driver was
killed does only the units without a marker. Scheduling, retries and placement are Ray's (or the
process pool's); nothing here is a scheduler.

    local, workers=0   (the default) auto_workers: one process per core when the input is big
                       enough to pay for a pool's start, else 1
    local, workers=1   in this process, in order (easiest to debug)
    local, workers=N   this process and N-1 spawned ones on this machine (fork is unsafe with
                       gcsfs' threads): a pool per run_units call, or one a stage opens with
                       stage_pool, whose processes start (and run its `warm`) while the driver
                       goes on; the driver runs units too, those the pool has not started
    ray                one Ray task per unit (1 CPU each, retried up to RAY_MAX_RETRIES times when
                       its worker dies) on the cluster at data.ray_address, else $RAY_ADDRESS,
                       else a Ray runtime started here with `workers` CPUs; on connecting, the
                       driver first has a worker started on every node (so short units spread)

Ray's driver is attached for one stage: a stage that attached it (ray.init) detaches it
(ray.shutdown) when it ends, whether it finished or failed, so no Ray runtime stays attached to the
process between stages (a test process outlives a cluster that ends, instead of Ray's core worker
ending it a minute later). A cluster address where nothing answers is refused at once (ConfigError,
exit 2); a cluster whose head (GCS) stops answering while its units run ends the stage within
RAY_LOST_S with one line (RayClusterLost, exit 1), and a rerun runs only the unfinished units.

Progress is the driver's only: it advances as units finish, by what each unit reports (its input
bytes and documents), across every node. Ray's own logs stay out of the terminal
unless CODEX_DEBUG=1.

Every unit, on either executor, runs as a task (_run_task) under the stage's TaskPolicy
(data.task.*): a transient I/O error (fsio.is_transient) runs the unit again after a backoff, in
its task; a unit running past data.task.timeout_s fails (UnitTimeout, naming it);
data.task.memory_gb is reserved per Ray task (Ray's memory=) and caps the local processes. Its
log lines go to a file of its own, RUN/logs/<phase>/<unit>.log (e.g. logs/clean_unit/000012.log),
whoever runs it. When a unit fails for good, no new unit starts, the units in flight finish
(keeping their markers), and then its exception is raised, one logged line naming the unit. Ray's
in-flight limit follows the cluster: its CPUs are read again every RAY_RESOURCES_S as nodes join
and leave.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import contextlib
import functools
import logging
import math
import multiprocessing as mp
import os
import queue
import re
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from codex.core import fsio
from codex.core.config import ConfigError
from codex.core.progress import (
    FILE_LOG_FORMAT,
    Progress,
    adopt_library_loggers,
    log_file,
    setup_logging,
)

log = logging.getLogger("codex.executor")

RAY_MAX_RETRIES = 3  # Ray's default for tasks; a unit is idempotent, so a retry is safe
# how long a started pool process waits for its siblings before it takes units anyway
POOL_START_S = 120.0
# how long the driver waits for a worker on every node before it gives the cluster units
RAY_WORKER_START_S = 60.0
RAY_INSTALL = "pip install 'codex[ray]'  (from a checkout: pip install -e '.[ray]')"
# how long a connect to the cluster's head (its GCS port) may take before it counts as no answer
RAY_CONNECT_S = 3.0
# while units run, how often the driver checks that the head answers, and how long it may not
# before the stage stops (Ray's own driver would wait 60 s, then end the process with status 1)
RAY_CHECK_S = 2.0
RAY_LOST_S = 10.0
# how often the driver reads the cluster's CPUs again while units run (nodes join and leave)
RAY_RESOURCES_S = 2.0

U = TypeVar("U")


@dataclass(frozen=True)
class TaskPolicy:
    """What every unit's task gets (data.task.*; codex/core/config/data.py: TaskConfig)."""

    memory_bytes: int = 0  # Ray's memory= reservation per task; 0: none
    timeout_s: float = 0.0  # a unit running longer fails (UnitTimeout); 0: no limit
    io_retries: int = 4  # attempts more after a transient I/O error
    ray_pending: int = 16  # Ray: units queued beyond the cluster's CPUs, at least


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
    """The TaskPolicy of data.task (TaskConfig); None: the defaults."""
    if task_cfg is None:
        return TaskPolicy()
    return TaskPolicy(
        memory_bytes=int(task_cfg.memory_gb * 1e9),
        timeout_s=float(task_cfg.timeout_s),
        io_retries=int(task_cfg.io_retries),
        ray_pending=int(task_cfg.ray_pending),
    )


def machine_memory() -> int:
    """Bytes of memory this process's machine (or its container's cgroup limit) has."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                total = min(total, int(f.read().strip()))
    return total


def slots(where: Where) -> int:
    """How many units run side by side: the local workers, or the Ray cluster's CPUs (a stage
    may cut its work into more units when it has fewer than this)."""
    if where.executor != "ray":
        return where.workers
    try:
        ray = connect_ray(where)
        return max(1, int(ray.cluster_resources().get("CPU", 1)))
    finally:
        if not _stages:  # not inside a stage (stage_pool): detach now
            detach_ray()


def run_units(
    fn: Callable[[U], Any],
    units: Sequence[U],
    where: Where,
    progress: Progress | None = None,
    count: Callable[[U, Any], dict[str, float]] | None = None,
) -> Iterator[tuple[U, Any]]:
    """Run fn on every unit, each as a task (_run_task: where.task's retries of transient I/O
    errors and timeout, a log file of its own); yield (unit, result) as each finishes. When a unit
    fails for good, no unit starts after it, those in flight finish (and are yielded), then its
    exception is raised here, one error line naming the unit logged first (an exception raised
    by fn that is not transient is not retried: bad input fails the same way twice; Ray retries a
    task whose worker died). Per finished unit: progress.update(1, **count(unit, result)), e.g.
    the bytes and documents it read."""
    if not units:
        return
    tasks = _task_specs(fn, units, where)
    if where.executor == "ray":
        runner = _run_ray(tasks, units, where)
    elif where.workers == 1 or len(units) == 1:
        runner = _run_in_order(tasks, units)
    else:
        runner = _run_pool(tasks, units, where)
    try:
        for unit, result in runner:
            if progress is not None:
                progress.update(1, **(count(unit, result) if count else {}))
            yield unit, result
    finally:
        # a caller that stops early (it raised) stops the units now, not when this is collected
        runner.close()
        if where.executor == "ray" and not _stages:  # not inside a stage (stage_pool): detach
            detach_ray()


# --- a unit's task: retries, timeout, log file -------------------------------------------------


class UnitTimeout(RuntimeError):
    """A unit ran past data.task.timeout_s (not a TimeoutError: that one is retried)."""


@dataclass(frozen=True)
class _Task:
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


def _task_specs(fn, units: Sequence, where: Where) -> list[_Task]:
    logs = where.logs or (os.path.dirname(log_file() or "") if log_file() else "")
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    phase = getattr(inner, "__name__", "unit")
    tasks = []
    for i, unit in enumerate(units):
        name = unit_name(unit, i)
        path = fsio.join(logs, phase, f"{name}.log") if logs else ""
        tasks.append(_Task(fn, phase, name, where.task, path))
    return tasks


def _run_task(task: _Task, unit):
    """task.fn(unit) in the process that runs the unit (this one, a pool process, a Ray worker),
    its log lines in its own file, run again after a transient I/O error (a unit is idempotent),
    stopped past its timeout."""
    with _task_log(task), _deadline(task):
        return fsio.with_retries(
            lambda: task.fn(unit),
            f"{task.phase} {task.name}",
            attempts=task.policy.io_retries + 1,
        )


@contextlib.contextmanager
def _deadline(task: _Task) -> Iterator[None]:
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


@contextlib.contextmanager
def _task_log(task: _Task) -> Iterator[None]:
    """While the unit runs, every log line of this process (codex's at INFO, the libraries' at
    the level they pass) goes to the unit's log file too, with one line when it starts and one
    when it ends (its time, or its error and traceback). A local file is appended to as lines
    come (a retry's lines follow the earlier attempt's); a remote one (gs://) is written once, at
    the end (an object cannot be appended to)."""
    if not task.log_path:
        yield
        return
    remote = fsio.is_remote(task.log_path)
    if remote:
        fd, path = tempfile.mkstemp(prefix="codex-task-", suffix=".log")
        os.close(fd)
    else:
        path = task.log_path
        os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path, mode="w" if remote else "a", encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FILE_LOG_FORMAT))
    root, codex = logging.getLogger(), logging.getLogger("codex")
    level = codex.level
    if codex.getEffectiveLevel() > logging.INFO:  # a Ray worker: the root at WARNING
        codex.setLevel(logging.INFO)
    root.addHandler(handler)
    what = f"{task.phase} {task.name}"

    def line(levelno: int, msg: str, exc_info=None) -> None:
        # to this file only: the terminal and the command's log file get no line per unit
        handler.handle(log.makeRecord(log.name, levelno, "", 0, msg, (), exc_info))

    line(logging.INFO, f"{what}: started on {worker_id()}")
    t0 = time.monotonic()
    try:
        yield
    except BaseException as e:
        line(
            logging.ERROR,
            f"{what}: failed after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}",
            sys.exc_info(),
        )
        raise
    else:
        line(logging.INFO, f"{what}: done in {time.monotonic() - t0:.1f}s")
    finally:
        root.removeHandler(handler)
        handler.close()
        codex.setLevel(level)
        if remote:
            try:
                fsio.upload(path, task.log_path)
            except Exception as e:  # the unit's own outcome stands; its log is lost
                log.warning("%s: could not write its log %s: %s", what, task.log_path, e)
            finally:
                os.unlink(path)


def _report_failures(failed: list[tuple[_Task, BaseException]], finished: int) -> BaseException:
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


def _run_in_order(tasks: list[_Task], units: Sequence) -> Generator[tuple[Any, Any]]:
    """Every unit in this process, in order; the first that fails ends the run."""
    for task, unit in zip(tasks, units, strict=True):
        failure: Exception | None = None
        try:
            result = _here(_run_task, task, unit)
        except Exception as e:
            failure = e
        if failure is not None:
            raise _report_failures([(task, failure)], 0)
        yield unit, result


def worker_id() -> str:
    """Who runs this unit: the Ray node and process inside a Ray task, else host and process
    (recorded in a unit's marker; never part of the output)."""
    if "ray" in sys.modules:
        ray = sys.modules["ray"]
        if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
            return f"ray-node-{ray.get_runtime_context().get_node_id()[:8]}:{os.getpid()}"
    return f"{socket.gethostname()}:{os.getpid()}"


# --- local: a process pool --------------------------------------------------------------------


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


def _new_pool(processes: int, warm: Callable[[], Any] | None = None):
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


@contextlib.contextmanager
def stage_pool(where: Where, warm: Callable[[], Any] | None = None) -> Iterator[Where]:
    """A Where whose run_units calls share one pool of `where.workers - 1` local processes (this
    one is the N-th), started now (each runs `warm`, e.g. loading what its units need, while the
    driver goes on) and closed on exit: a stage of several phases spawns its workers once, not
    once per phase. Ray and workers=1: `where` itself; for Ray, the driver attached by the
    stage's first unit stays attached until the stage ends, then detaches (detach_ray)."""
    global _stages
    if where.executor == "ray":
        _stages += 1
        try:
            yield where
        finally:
            _stages -= 1
            if not _stages:
                detach_ray()
        return
    if where.workers == 1:
        yield where
        return
    pool, up = _new_pool(where.workers - 1, warm)
    with pool:
        yield replace(where, pool=pool, started=up)


def _nothing() -> None:
    pass


def _run_pool(tasks: list[_Task], units: Sequence, where: Where) -> Generator[tuple[Any, Any]]:
    """Every unit's task, on where.workers processes: this one and a pool of the others (the
    stage's, else one for this call). Each pool process is fed one unit once it has started, and
    the next as it finishes one (done-callbacks, on the pool's thread: no process waits on this
    one); this process runs units too, handing on what the pool finished in between, then waits
    for the pool's last. Every process takes the next unit from the front of the list, so units
    start in the list's order (a stage puts its small units last: the processes run out of work
    together). So this process works from the start (while the others spawn and import), a phase
    shorter than a pool's start runs here whole, and no unit waits queued in the pool while a
    process idles at the end. A unit that fails stops the feeding; the units in flight finish
    and are yielded before its exception is raised. (One function, over 60 lines: the callbacks
    and the loop share todo, running and the lock.)"""
    n = min(where.workers, len(units))
    todo = collections.deque(zip(tasks, units, strict=True))
    running: dict[cf.Future, tuple[_Task, Any]] = {}  # in the pool: future -> (task, unit)
    finished: queue.SimpleQueue = queue.SimpleQueue()  # futures the pool has finished
    broken: list[BaseException] = []  # the pool could take no unit (a process died)
    failed: list[tuple[_Task, BaseException]] = []  # units that failed for good
    lock = threading.Lock()  # todo, running and broken, shared with the pool's thread
    pool, started = (where.pool, where.started) if where.pool else _new_pool(n - 1)
    with contextlib.nullcontext(pool) if where.pool else pool:

        def feed(_started: cf.Future | None = None) -> None:
            with lock:
                if not todo:
                    return
                task, unit = todo.popleft()
                try:
                    fut = pool.submit(_run_task, task, unit)
                except Exception as e:  # broken, shut down: raised by the loop, unit kept
                    todo.appendleft((task, unit))
                    broken.append(e)
                    return
                running[fut] = (task, unit)
            fut.add_done_callback(next_unit)

        def next_unit(done: cf.Future) -> None:
            finished.put(done)
            if not done.cancelled():
                feed()

        def fail(task: _Task, e: BaseException) -> None:
            failed.append((task, e))
            with lock:
                todo.clear()  # no new unit; those in flight finish

        done_after = 0  # units that finished after the first failure
        try:
            for first in started[: n - 1]:
                first.add_done_callback(feed)
            while True:
                while not finished.empty():
                    fut = finished.get()
                    with lock:
                        task, unit = running.pop(fut)
                    try:
                        result = fut.result()
                    except Exception as e:
                        fail(task, e)
                        continue
                    done_after += bool(failed)
                    # popped: the driver holds no result it has already handed on
                    yield unit, result
                with lock:
                    if broken and not running:
                        raise broken[0]
                    item = todo.popleft() if todo else None
                    waiting = bool(running)
                if item is not None:
                    task, unit = item
                    try:
                        result = _here(_run_task, task, unit)
                    except Exception as e:
                        fail(task, e)
                        continue
                    done_after += bool(failed)
                    yield unit, result
                elif not waiting:
                    if failed:
                        raise _report_failures(failed, done_after)
                    return
                else:
                    finished.put(finished.get())  # block until the pool finishes one
        except BaseException:
            with lock:
                todo.clear()
                left = list(running)
            # not under the lock: cancel runs the done-callbacks here. A unit fed to the pool is
            # already running there (queued counts as running), so this rarely cancels one: the
            # pool's exit waits for them, and their results are dropped
            for fut in left:
                fut.cancel()
            raise


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


# --- ray --------------------------------------------------------------------------------------


def import_ray():
    """The ray module, or exit 2 saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--executor ray needs Ray, not installed: {RAY_INSTALL}") from None
    return ray


_connected: str | None = None  # the address this process's Ray driver is attached to
_stages = 0  # Ray stages (stage_pool) in progress in this process: they keep the driver attached
_watch: _HeadWatch | None = None  # the check that the attached cluster's head answers


class RayClusterLost(RuntimeError):
    """The cluster's head (GCS) stopped answering while the driver waited for units."""


def _ray_address(where_address: str) -> tuple[str | None, str]:
    """The cluster's address (data.ray_address, else $RAY_ADDRESS, else None: a runtime started
    here) and where it was set, for messages."""
    if where_address:
        return where_address, "data.ray_address (--ray-address)"
    env = os.environ.get("RAY_ADDRESS")
    return (env, "$RAY_ADDRESS") if env else (None, "")


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a cluster address 'HOST:PORT' or 'ray://HOST:PORT'; None for the others
    Ray resolves itself ('auto', 'local')."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _answers(host_port: tuple[str, int], timeout: float) -> str:
    """'' when a TCP connect to host_port succeeds within timeout, else why not."""
    try:
        with socket.create_connection(host_port, timeout=timeout):
            return ""
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def check_ray_address(where_address: str) -> None:
    """A ConfigError (exit 2) at once when nothing answers at the cluster's address: ray.init
    would retry it for ever, printing Ray's warnings."""
    address, source = _ray_address(where_address)
    host_port = _host_port(address) if address else None
    if host_port is None:
        return
    why = _answers(host_port, RAY_CONNECT_S)
    if why:
        raise ConfigError(
            f"{source} is {address}, but no Ray cluster answers there ({why}): start the "
            f"cluster (ray start --head --port {host_port[1]}) or give the address of its head, "
            "HOST:PORT (the GCS port, 6379 by default)"
        )


class _HeadWatch:
    """The driver's check that the cluster's head answers, while it waits for units: a TCP
    connect to its GCS port at most every RAY_CHECK_S; RayClusterLost once none has answered for
    RAY_LOST_S. (Ray's driver would wait 60 s, then end the process with its own C++ line; units
    may meanwhile go on finishing on the other nodes, so the check runs whether or not they do.)"""

    def __init__(self, ray, address: str | None):
        try:
            gcs = ray.get_runtime_context().gcs_address
        except Exception:  # an older Ray, a client connection: the address given
            gcs = address
        self.host_port = _host_port(gcs or "")
        self.address = address or gcs or "local"
        self.checked = time.monotonic()
        self.failing_since: float | None = None  # the first check of those that got no answer

    def check(self, now: bool = False) -> bool:
        """Whether the head answered at the last check (made now, if RAY_CHECK_S has passed
        since the one before, or `now`); RayClusterLost when none has for RAY_LOST_S."""
        if self.host_port is None:
            return True
        t = time.monotonic()
        if not now and t - self.checked < RAY_CHECK_S:
            return self.failing_since is None
        self.checked = t
        why = _answers(self.host_port, RAY_CHECK_S)
        if not why:
            self.failing_since = None
            return True
        if self.failing_since is None:
            self.failing_since = t
        if time.monotonic() - self.failing_since >= RAY_LOST_S:
            raise RayClusterLost(
                f"lost the Ray cluster at {self.address}: its head (GCS) has not answered for "
                f"{RAY_LOST_S:g} s ({why}); the finished units are kept: rerun the same command "
                "once the cluster is back (or with --ray-address of a new one) and it runs only "
                "the unfinished units"
            )
        return False

    def answering(self) -> None:
        """Return once the head answers (at once, usually); RayClusterLost after RAY_LOST_S
        without. Before a call that asks the head itself (cluster_resources): with the head gone
        it would wait for Ray's own timeouts."""
        while not self.check(now=True):
            time.sleep(RAY_CHECK_S)


def _wait(ray, refs: list, num_returns: int, timeout: float | None, watch: _HeadWatch) -> list:
    """ray.wait in slices of a second, checking the head (watch) after each: the refs done once
    num_returns are, or at timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
        done, _ = ray.wait(refs, num_returns=num_returns, timeout=left)
        watch.check()
        if len(done) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
            return done


# Ray's C++ log line: "[2026-11-27 17:57:05,433 E 24641 24661] task_manager.cc:1545: ..."
_RAY_CPP_LINE = re.compile(rb"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [DIWEF] \d+ \d+\] ")
# ... and what may be the start of one, until its end arrives
_RAY_CPP_START = re.compile(rb"\[[\d\- :,]*(?:[DIWEF](?: [\d ]*\]?)?)?")


class _RayLinesToLogFile:
    """While the driver is attached to a cluster: this process's stderr (fd 2) goes through a
    thread that files Ray's C++ log lines (its core worker writes ERROR and above to stderr, e.g.
    while the cluster's head is gone) in the log file (RUN/logs/), and passes every other byte on to
    the stderr it had, unchanged and at once. A terminal stays a terminal: a pty in between, of
    the terminal's size, so a progress bar is drawn as before."""

    def __init__(self) -> None:
        sys.stderr.flush()
        self.saved = os.dup(2)
        if os.isatty(self.saved):
            import fcntl
            import termios
            import tty

            self.read_fd, write_fd = os.openpty()
            tty.setraw(write_fd)  # bytes through as written (no "\n" -> "\r\n")
            with contextlib.suppress(OSError):
                size = fcntl.ioctl(self.saved, termios.TIOCGWINSZ, b"\0" * 8)
                fcntl.ioctl(write_fd, termios.TIOCSWINSZ, size)
        else:
            self.read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._pump, name="codex-ray-stderr", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        held = b""  # what may be the start of a Ray line, until its end arrives
        while True:
            # a held start of a line goes on after half a second without its end
            ready = select.select([self.read_fd], [], [], 0.5)[0]
            try:
                chunk = os.read(self.read_fd, 1 << 16) if ready else b""
            except OSError:  # a pty whose other end is closed
                chunk = b""
            if not chunk and (self.stop.is_set() or ready):
                break
            data, held = held + chunk, b""
            *lines, tail = data.split(b"\n")
            through = []
            for line in lines:
                # a Ray line may follow a progress bar's (no newline) on the terminal
                m = _RAY_CPP_LINE.search(line)
                if m:
                    through.append(line[: m.start()])
                    text = line[m.start() :].decode(errors="replace").rstrip()
                    log.info("ray: %s", text, extra={"file_only": True})
                else:
                    through.append(line + b"\n")
            m = _RAY_CPP_LINE.search(tail)
            start = m.start() if m else tail.rfind(b"[")
            if chunk and start >= 0 and (m or _RAY_CPP_START.fullmatch(tail, start)):
                tail, held = tail[:start], tail[start:]
            through.append(tail)
            self._write(b"".join(through))
        self._write(held)

    def _write(self, data: bytes) -> None:
        while data:
            try:
                data = data[os.write(self.saved, data) :]
            except OSError:  # the terminal is gone
                return

    def close(self) -> None:
        """fd 2 as it was; what the thread has not passed on yet is passed on first."""
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        # first the thread reads what was written: a pty may drop unread output once its
        # writing end is closed
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and select.select([self.read_fd], [], [], 0)[0]:
            time.sleep(0.01)
        os.dup2(self.saved, 2)
        self.stop.set()
        self.thread.join(timeout=5)
        os.close(self.read_fd)
        os.close(self.saved)


_ray_lines: _RayLinesToLogFile | None = None


def _close_ray_lines() -> None:
    global _ray_lines
    if _ray_lines is not None:
        _ray_lines.close()
        _ray_lines = None


def detach_ray() -> None:
    """Detach this process's Ray driver if connect_ray attached it (a runtime the host program
    started itself is left alone). Its processes no longer watch the cluster: the process goes
    on when the cluster ends (an attached driver would be ended by Ray 60 s later)."""
    global _connected, _watch
    if _connected is None:
        return
    _connected = _watch = None
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            t0 = time.monotonic()
            ray.shutdown()
            log.debug("ray: detached from the cluster in %.1fs", time.monotonic() - t0)
    finally:
        _close_ray_lines()


def connect_ray(where: Where):
    """Attach to the cluster (data.ray_address, else $RAY_ADDRESS) or start a runtime here; a
    ConfigError at once when nothing answers at the address."""
    global _connected, _watch, _ray_lines
    ray = import_ray()
    address, _ = _ray_address(where.ray_address)
    if ray.is_initialized():
        if _connected == (address or "local"):
            if _watch is not None:  # a later phase of the stage: the head is still there
                _watch.answering()
            return ray
        ray.shutdown()  # attached elsewhere (another stage of this process asked for another)
        _connected = _watch = None
    check_ray_address(where.ray_address)
    debug = bool(os.environ.get("CODEX_DEBUG"))
    # Ray's driver lines go through codex's handlers: INFO to the log file (RUN/logs/), ERROR and
    # above to the terminal (codex/core/progress.py: TERMINAL_LEVELS)
    adopt_library_loggers()
    # No runtime_env: tasks then run on the workers each raylet keeps warm for the default
    # environment instead of new ones; _one_cpu sets a task's threads.
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": debug,
        "logging_level": logging.INFO if debug or log_file() else logging.ERROR,
    }
    if address is None:
        kwargs["num_cpus"] = where.workers
    # Ray's C++ lines to the log file: only for a cluster's driver (a runtime started here starts
    # its processes from this one, and they would inherit the pipe)
    if address is not None and not debug and _ray_lines is None:
        try:
            _ray_lines = _RayLinesToLogFile()
        except OSError as e:  # no fd 2, no pty: Ray's lines stay on stderr
            log.debug("ray: its stderr lines stay on stderr (%s)", e)
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as e:
        _close_ray_lines()
        raise ConfigError(f"cannot reach the Ray cluster at {address}: {e}") from None
    except BaseException:
        _close_ray_lines()
        raise
    _connected = address or "local"
    _watch = _HeadWatch(ray, address)
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    cpus = int(ray.cluster_resources().get("CPU", 0))
    t0 = time.monotonic()
    ready = _a_worker_on_every_node(ray, nodes, _watch)
    log.info(
        "ray: %s, %d node(s), %d CPUs, a worker ready on %d of them in %.1fs",
        f"cluster at {address}" if address else "local runtime",
        len(nodes),
        cpus,
        ready,
        time.monotonic() - t0,
    )
    return ray


def _a_worker_on_every_node(ray, nodes: list[str], watch: _HeadWatch) -> int:
    """Start this job's first worker on every node, waiting up to RAY_WORKER_START_S for them;
    how many started. Ray hands a task queued behind a running one to the worker it already
    leased, so without this short units all run on the first node whose worker is up (the
    driver's) while the others are still starting theirs. 0 CPUs: a busy node still starts one."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, max_retries=0)(_nothing)
    refs = [
        probe.options(
            name="codex_start_worker",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
        ).remote()
        for node in nodes
    ]
    return len(_wait(ray, refs, len(refs), RAY_WORKER_START_S, watch))


def _ray_task(task: _Task, unit):
    """A Ray task: the unit's task on its one CPU. Ray sets OMP_NUM_THREADS to the task's CPUs;
    the encoder's thread pool (rayon, built on first use in the worker) is held to one thread
    too."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return _run_task(task, unit)


def in_flight_limit(cpus: int, pending: int) -> int:
    """How many units the driver keeps submitted to a cluster of `cpus` CPUs: one running on
    each, and as many queued (so every worker has its next unit), but at least `pending` queued:
    an autoscaler adds nodes for the demand it sees queued, and a cluster whose workers scale up
    from zero (a 0-CPU head) would otherwise see almost none."""
    return max(1, cpus + max(cpus, pending))


class _Limit:
    """The in-flight limit of a Ray run, from the cluster's CPUs read again every
    RAY_RESOURCES_S while units run: it rises as nodes join and falls as they leave (a unit
    already submitted stays). Each change is logged ("ray: N CPUs ...")."""

    def __init__(self, ray, pending: int, watch: _HeadWatch):
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


def _run_ray(tasks: list[_Task], units: Sequence, where: Where) -> Generator[tuple[Any, Any]]:
    ray = connect_ray(where)
    watch = _watch or _HeadWatch(ray, _ray_address(where.ray_address)[0])
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
    todo = list(zip(tasks, units, strict=True))
    todo.reverse()
    running: dict[Any, tuple[_Task, Any]] = {}
    failed: list[tuple[_Task, BaseException]] = []
    done_after = 0
    try:
        while (todo and not failed) or running:
            while todo and not failed and len(running) < limit.read():
                task, u = todo.pop()
                running[named.remote(task, u)] = (task, u)
            done = _wait(ray, list(running), 1, RAY_RESOURCES_S, watch)
            for ref in done:
                task, u = running.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    failed.append((task, cause if isinstance(cause, BaseException) else e))
                    continue
                except ray.exceptions.RayError as e:  # its worker died RAY_MAX_RETRIES + 1 times
                    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    failed.append((task, UnitFailed(f"{task.phase} {task.name}: {why}")))
                    continue
                done_after += bool(failed)
                yield u, result
    except RayClusterLost:
        raise  # nothing left to cancel them
    except BaseException:
        for ref in running:
            ray.cancel(ref, force=True)
        raise
    if failed:
        raise _report_failures(failed, done_after)


class UnitFailed(RuntimeError):
    """A unit's Ray task failed without an exception of its own (its worker died, every retry)."""
