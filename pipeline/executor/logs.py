"""Where a unit's log lines go: its own file, RUN/logs/<phase>/<unit>.log (unit_log), whoever runs
it; and, while the driver is attached to a Ray cluster, Ray's C++ lines on stderr to the command's
log file (RayLinesToLogFile). docs/ray.md has the details.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

from codex.core import fsio
from codex.core.progress import FILE_LOG_FORMAT

log = logging.getLogger("codex.executor")


# how often a unit's log on an object store is written again while the unit runs (when it has
# new lines): what a unit killed mid-run (for memory, say) leaves is its log up to then
UNIT_LOG_UPLOAD_S = 30.0


@contextlib.contextmanager
def unit_log(what: str, log_path: str) -> Iterator[None]:
    """While the unit `what` (its phase and name) runs, every log line of this process (codex's
    at INFO, the libraries' at the level they pass) goes to its log file too, with one line when
    it starts and one when it ends (its time, or its error and traceback). A local file is
    appended to as lines come (a retry's lines follow the earlier attempt's); a remote one (gs://)
    is written from a local copy every UNIT_LOG_UPLOAD_S while the unit runs (an object cannot be
    appended to) and once more at the end. log_path "": no file."""
    if not log_path:
        yield
        return
    remote = fsio.is_remote(log_path)
    if remote:
        fd, path = tempfile.mkstemp(prefix="codex-task-", suffix=".log")
        os.close(fd)
    else:
        path = log_path
        os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path, mode="w" if remote else "a", encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FILE_LOG_FORMAT))
    root, codex = logging.getLogger(), logging.getLogger("codex")
    level = codex.level
    if codex.getEffectiveLevel() > logging.INFO:  # a Ray worker: the root at WARNING
        codex.setLevel(logging.INFO)
    root.addHandler(handler)

    def line(levelno: int, msg: str, exc_info=None) -> None:
        # to this file only: the terminal and the command's log file get no line per unit
        handler.handle(log.makeRecord(log.name, levelno, "", 0, msg, (), exc_info))

    line(logging.INFO, f"{what}: started on {worker_id()}")
    uploads = _Uploads(what, path, log_path) if remote else None
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
        if uploads is not None:
            try:
                uploads.last()
            finally:
                os.unlink(path)


class _Uploads:
    """A remote unit log's local copy written to the store while the unit runs: by a thread,
    every UNIT_LOG_UPLOAD_S when the copy has grown, then once more at the end (last)."""

    def __init__(self, what: str, path: str, log_path: str):
        self.what, self.path, self.log_path = what, path, log_path
        self.sent = 0  # the copy's size at the last upload
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="codex-unit-log", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(UNIT_LOG_UPLOAD_S):
            self._send(final=False)

    def _send(self, final: bool) -> None:
        try:
            size = os.path.getsize(self.path)
            if size != self.sent or final:
                fsio.upload(self.path, self.log_path)
                self.sent = size
        except Exception as e:  # the unit's own outcome stands; its log is lost
            if final:
                log.warning("%s: could not write its log %s: %s", self.what, self.log_path, e)
            else:
                log.debug("%s: could not write its log yet: %s", self.what, e)

    def last(self) -> None:
        """Stop the thread (after an upload it has begun), then write the whole log."""
        self.stop.set()
        self.thread.join()
        self._send(final=True)


def worker_id() -> str:
    """Who runs this unit: the Ray node and process inside a Ray task, else host and process
    (recorded in a unit's marker; never part of the output)."""
    if "ray" in sys.modules:
        ray = sys.modules["ray"]
        if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
            return f"ray-node-{ray.get_runtime_context().get_node_id()[:8]}:{os.getpid()}"
    return f"{socket.gethostname()}:{os.getpid()}"


# Ray's C++ log line: "[2026-11-27 17:57:05,433 E 24641 24661] task_manager.cc:1545: ..."
_RAY_CPP_LINE = re.compile(rb"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [DIWEF] \d+ \d+\] ")
# ... and what may be the start of one, until its end arrives
_RAY_CPP_START = re.compile(rb"\[[\d\- :,]*(?:[DIWEF](?: [\d ]*\]?)?)?")


class RayLinesToLogFile:
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
