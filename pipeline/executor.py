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
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import re
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from codex.core.config import ConfigError
from codex.core.progress import Progress, adopt_library_loggers, log_file, setup_logging

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

U = TypeVar("U")


@dataclass(frozen=True)
class Where:
    """How a stage runs its units: `data.executor`, `data.ray_address` and the stage's workers."""

    executor: str = "local"  # local | ray
    workers: int = 1
    ray_address: str = ""
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


def where_for(data_cfg, workers: int, input_bytes: int = 0, bytes_per_worker: int = 1) -> Where:
    """The Where of a stage from the data config (data.executor, data.ray_address); workers 0
    is auto_workers(input_bytes, bytes_per_worker) (a Ray runtime started here: every core)."""
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
    return Where(data_cfg.executor, workers, data_cfg.ray_address)


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
    """Run fn on every unit; yield (unit, result) as each finishes. A unit's exception is raised
    here (after Ray's retries for a dead worker; an exception raised by fn itself is not retried:
    bad input fails the same way twice). Per finished unit: progress.update(1, **count(unit,
    result)), e.g. the bytes and documents it read."""
    if not units:
        return
    if where.executor == "ray":
        runner = _run_ray(fn, units, where)
    elif where.workers == 1 or len(units) == 1:
        runner = ((u, fn(u)) for u in units)
    else:
        runner = _run_pool(fn, units, where)
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


def _run_pool(fn, units, where: Where) -> Generator[tuple[Any, Any]]:
    """fn on every unit, on where.workers processes: this one and a pool of the others (the
    stage's, else one for this call). Each pool process is fed one unit once it has started, and
    the next as it finishes one (done-callbacks, on the pool's thread: no process waits on this
    one); this process runs units too, handing on what the pool finished in between, then waits
    for the pool's last. Every process takes the next unit from the front of the list, so units
    start in the list's order (a stage puts its small units last: the processes run out of work
    together). So this process works from the start (while the others spawn and import), a phase
    shorter than a pool's start runs here whole, and no unit waits queued in the pool while a
    process idles at the end. (One function, over 60 lines: the callbacks and the loop share
    todo, running and the lock.)"""
    n = min(where.workers, len(units))
    todo = collections.deque(units)
    running: dict[cf.Future, Any] = {}  # in the pool: future -> unit
    finished: queue.SimpleQueue = queue.SimpleQueue()  # futures the pool has finished
    broken: list[BaseException] = []  # the pool could take no unit (a process died)
    lock = threading.Lock()  # todo, running and broken, shared with the pool's thread
    pool, started = (where.pool, where.started) if where.pool else _new_pool(n - 1)
    with contextlib.nullcontext(pool) if where.pool else pool:

        def feed(_started: cf.Future | None = None) -> None:
            with lock:
                if not todo:
                    return
                unit = todo.popleft()
                try:
                    fut = pool.submit(fn, unit)
                except Exception as e:  # broken, shut down: raised by the loop, unit kept
                    todo.appendleft(unit)
                    broken.append(e)
                    return
                running[fut] = unit
            fut.add_done_callback(next_unit)

        def next_unit(done: cf.Future) -> None:
            finished.put(done)
            if not done.cancelled():
                feed()

        try:
            for first in started[: n - 1]:
                first.add_done_callback(feed)
            while True:
                while not finished.empty():
                    fut = finished.get()
                    with lock:
                        unit = running.pop(fut)
                    # popped: the driver holds no result it has already handed on
                    yield unit, fut.result()  # re-raises the unit's exception
                with lock:
                    if broken and not running:
                        raise broken[0]
                    unit = todo.popleft() if todo else None
                    waiting = bool(running)
                if unit is not None:
                    yield unit, _here(fn, unit)
                elif not waiting:
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


def _here(fn, unit):
    """fn(unit) in this process, its environment as it was after (a unit may set its threads,
    e.g. shard's RAYON_NUM_THREADS, for the process it runs in; this one goes on after the
    stage)."""
    env = dict(os.environ)
    try:
        return fn(unit)
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


def _one_cpu(fn, unit):
    """A Ray task: fn(unit) on its one CPU. Ray sets OMP_NUM_THREADS to the task's CPUs; the
    encoder's thread pool (rayon, built on first use in the worker) is held to one thread too."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return fn(unit)


def _run_ray(fn, units, where: Where) -> Generator[tuple[Any, Any]]:
    ray = connect_ray(where)
    watch = _watch or _HeadWatch(ray, _ray_address(where.ray_address)[0])
    # SPREAD: units go to every node from the start, rather than packing onto the first node until
    # it is saturated (short units could all finish there before another node starts a worker)
    task = ray.remote(
        num_cpus=1,
        max_retries=RAY_MAX_RETRIES,
        retry_exceptions=False,
        scheduling_strategy="SPREAD",
    )(_one_cpu)
    named = task.options(name=fn.__name__)  # `ray::clean_unit` in ps and Ray's state API
    # A bounded number in flight: the driver holds refs, not results, and a huge plan does not
    # flood the scheduler; twice the CPUs keeps every worker fed.
    limit = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    queue = list(units)
    queue.reverse()
    running: dict[Any, Any] = {}
    try:
        while queue or running:
            while queue and len(running) < limit:
                u = queue.pop()
                running[named.remote(fn, u)] = u
            done = _wait(ray, list(running), 1, None, watch)
            for ref in done:
                u = running.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    raise (cause if isinstance(cause, BaseException) else e) from None
                yield u, result
    except RayClusterLost:
        raise  # nothing left to cancel them
    except BaseException:
        for ref in running:
            ray.cancel(ref, force=True)
        raise
