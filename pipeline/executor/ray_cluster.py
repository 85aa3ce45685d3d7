"""The driver's attachment to a Ray cluster: the address checked before anything starts
(check_ray_address), attached once for a stage and detached when it ends (connect_ray, detach_ray,
attached_for_stage), a worker started on every node first, and the head watched while units run
(RayClusterLost within RAY_LOST_S). docs/ray.md has the details.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

from codex.core.config import ConfigError
from codex.core.progress import adopt_library_loggers, log_file
from codex.pipeline.executor.logs import RayLinesToLogFile

log = logging.getLogger("codex.executor")

# how long the driver waits for a worker on every node before it gives the cluster units
RAY_WORKER_START_S = 60.0
RAY_INSTALL = "pip install 'codex[ray]'  (from a checkout: pip install -e '.[ray]')"
# how long a connect to the cluster's head (its GCS port) may take before it counts as no answer
RAY_CONNECT_S = 3.0
# while units run, how often the driver checks that the head answers, and how long it may not
# before the stage stops (Ray's own driver would wait 60 s, then end the process with status 1)
RAY_CHECK_S = 2.0
RAY_LOST_S = 10.0


def import_ray():
    """The ray module, or exit 2 saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--executor ray needs Ray, not installed: {RAY_INSTALL}") from None
    return ray


_connected: str | None = None  # the address this process's Ray driver is attached to
_stages = 0  # Ray stages (stage_pool) in progress in this process: they keep the driver attached
_watch: HeadWatch | None = None  # the check that the attached cluster's head answers
_ray_lines: RayLinesToLogFile | None = None  # Ray's C++ lines to the log file, while attached


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


class HeadWatch:
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


def wait(ray, refs: list, num_returns: int, timeout: float | None, watch: HeadWatch) -> list:
    """ray.wait in slices of a second, checking the head (watch) after each: the refs done once
    num_returns are, or at timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
        done, _ = ray.wait(refs, num_returns=num_returns, timeout=left)
        watch.check()
        if len(done) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
            return done


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


def connect_ray(ray_address: str, workers: int):
    """Attach to the cluster (data.ray_address, else $RAY_ADDRESS) or start a runtime here with
    `workers` CPUs; a ConfigError at once when nothing answers at the address."""
    global _connected, _watch, _ray_lines
    ray = import_ray()
    address, _ = _ray_address(ray_address)
    if ray.is_initialized():
        if _connected == (address or "local"):
            if _watch is not None:  # a later phase of the stage: the head is still there
                _watch.answering()
            return ray
        ray.shutdown()  # attached elsewhere (another stage of this process asked for another)
        _connected = _watch = None
    check_ray_address(ray_address)
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
        kwargs["num_cpus"] = workers
    # Ray's C++ lines to the log file: only for a cluster's driver (a runtime started here starts
    # its processes from this one, and they would inherit the pipe)
    if address is not None and not debug and _ray_lines is None:
        try:
            _ray_lines = RayLinesToLogFile()
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
    _watch = HeadWatch(ray, address)
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


def _a_worker_on_every_node(ray, nodes: list[str], watch: HeadWatch) -> int:
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
    return len(wait(ray, refs, len(refs), RAY_WORKER_START_S, watch))


def _nothing() -> None:
    pass


def head_watch(ray, ray_address: str) -> HeadWatch:
    """The check that the attached cluster's head answers (connect_ray's, else a new one)."""
    return _watch or HeadWatch(ray, _ray_address(ray_address)[0])


@contextlib.contextmanager
def attached_for_stage() -> Iterator[None]:
    """While a stage runs: the driver a unit attached stays attached until the stage (the last of
    nested ones) ends, then detaches (detach_ray)."""
    global _stages
    _stages += 1
    try:
        yield
    finally:
        _stages -= 1
        if not _stages:
            detach_ray()


def detach_outside_stage() -> None:
    """detach_ray, unless a stage (attached_for_stage) keeps the driver attached."""
    if not _stages:
        detach_ray()
