"""train.async_save: a checkpoint written by this rank's writer process while training goes on.

`save_in_background` copies what this rank writes into a staging buffer kept across saves (the
only part that blocks) and hands it to the rank's `BackgroundWriter`, a fresh interpreter that
runs the blocking save's protocol (folders.py: commit). Why a process and not torch's own async
save: docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import mmap
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from codex.train.checkpoint import dcp as dcp_io
from codex.train.checkpoint.folders import commit, step_dir
from codex.train.distributed.control import CONTROL_TIMEOUT_S, ControlPlane


@dataclass
class PendingSave:
    """A checkpoint being written (save_in_background), or already written (done())."""

    folder: str
    writer: BackgroundWriter | None = None  # until wait() has its result
    writer_pid: int | None = None  # the process that wrote it (after wait(); None: this one)
    error: BaseException | None = None

    @classmethod
    def done(cls, folder: str) -> PendingSave:
        return cls(folder)

    def wait(self) -> str:
        """Block until the checkpoint is complete (DONE written on rank 0); re-raise its error."""
        if self.writer is not None:
            writer, self.writer = self.writer, None
            try:
                self.writer_pid = writer.result()
            except BaseException as e:  # kept: every wait() raises it
                self.error = e
        if self.error is not None:
            raise self.error
        return self.folder


def save_in_background(
    run: str, state: dict, writer: BackgroundWriter, keep_last: int = 3, keep_every: int = 0
) -> PendingSave:
    """save() through `writer` (this rank's BackgroundWriter; every rank calls this together):
    the tensors this rank writes are copied into the writer's staging buffer now (the only part
    that blocks), then its process writes them, and rank 0's writes state.json and DONE once
    every rank's has finished, and prunes, while training goes on. Wait on the result before the
    next save (the buffer is reused). A job that dies meanwhile takes its writers with it and
    leaves the folder without DONE: not a checkpoint, the previous one counts."""
    return writer.submit(run, state, (keep_last, keep_every))


@dataclass(frozen=True)
class _Request:
    """One save, as the writer process gets it (the tensors are in the staging buffer)."""

    run: str
    step: int
    tree: dict  # this rank's skeleton: state.json's part of it
    keep: tuple[int, int]
    plan: dcp_io.StagedPlan | None  # with a new buffer (its fd follows the request), else None


@dataclass
class _Link:
    """The parent's end of one writer process (what its shutdown needs, without the writer)."""

    process: Any
    conn: Any
    busy: bool = False  # a request sent and its reply not yet read


class BackgroundWriter:
    """This rank's checkpoint writer for train.async_save: a staging cache (train/checkpoint/dcp.py:
    staged) and a process of its own that writes from it, so the write holds no lock the
    training loop needs (a thread would share the GIL: DCP pickles, hashes and plans in
    Python). The processes of all ranks form their own gloo group, met through the job's
    rendezvous store, for DCP's collectives and the blocking save's protocol (`commit`: DONE
    last, by rank 0, once every rank has written; retention). Started on the first save, one
    save at a time; close() at the end.

    torch's dcp.async_save(async_checkpointer_type=PROCESS) has such a process too, but it
    returns DCP's metadata only (not the files' sha256s DONE records), leaves DONE's collective to
    the trainer, and re-sends every tensor's handle with each save; here the buffer is sent once.
    """

    def __init__(self, control: ControlPlane | None = None) -> None:
        self.control = control or ControlPlane()
        self.cache = dcp_io.StagingCache()
        self._link: _Link | None = None
        self._sender: threading.Thread | None = None
        self._send_errors: list[BaseException] = []
        self._finalizer: Any = None

    @property
    def pid(self) -> int | None:
        """The writer process's pid (None before the first save)."""
        return self._link.process.pid if self._link is not None else None

    def submit(self, run: str, state: dict, keep: tuple[int, int]) -> PendingSave:
        """Stage `state` and hand it to the writer process (save_in_background)."""
        if self._link is not None and self._link.busy:
            raise RuntimeError("wait() on the previous background save before the next one")
        step = int(state["step"])
        new = dcp_io.staged(state, self.cache, self.control)
        if self._link is None:
            self._start()
        assert self._link is not None and self.cache.buffer is not None
        tree = dcp_io.skeleton(state)
        request = _Request(run, step, tree, keep, self.cache.plan if new else None)
        fd = self.cache.buffer.fd if new else None
        self._link.busy = True
        # Sent from a thread: a writer still starting (importing torch) would not read the
        # request yet, and the pipe's buffer may be smaller than it.
        self._sender = threading.Thread(
            target=_send, args=(self._link, request, fd, self._send_errors), daemon=True
        )
        self._sender.start()
        return PendingSave(step_dir(run, step), writer=self)

    def result(self) -> int:
        """Block until the save in flight is complete on every rank; its writer's pid. Raises its
        error (as the writer raised it, or a RuntimeError when it died)."""
        link = self._link
        assert link is not None and link.busy and self._sender is not None
        self._sender.join()
        try:
            if self._send_errors:
                raise self._send_errors.pop()
            pid, error = link.conn.recv()
        except (EOFError, OSError) as e:
            with contextlib.suppress(subprocess.TimeoutExpired):
                link.process.wait(timeout=5)
            raise RuntimeError(
                f"the checkpoint writer process (pid {link.process.pid}) died "
                f"(exit code {link.process.returncode}): {e!r}"
            ) from None
        finally:
            link.busy = False
        if error is not None:
            raise error
        return int(pid)

    def _start(self) -> None:
        """Start the writer process (every rank together: rank 0 names the writers' group). A
        fresh interpreter that imports only this module: multiprocessing's spawn would also run
        the trainer's __main__ again (a script without a __main__ guard would train in it), and
        fork would copy CUDA's and gloo's threads."""
        meet = _meeting_point(self.control)
        parent, child = socket.socketpair()  # the buffer's fd travels over it (SCM_RIGHTS)
        command = [sys.executable, "-c", _WRITER_MAIN, str(child.fileno())]
        # Blocked here, SIGINT and SIGTERM stay blocked in the writer from its first instruction:
        # Ctrl-C (sent to the whole process group) and torchrun's SIGTERM (sent to the worker's
        # group) are the trainer's to handle; the writer finishes the save the trainer waits on.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            process = subprocess.Popen(command, pass_fds=[child.fileno()])
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
            child.close()
        conn = multiprocessing.connection.Connection(parent.detach())
        conn.send(list(sys.path))  # before anything that needs codex's packages to unpickle
        conn.send((self.control.rank, self.control.world, meet, os.getpid()))
        self._link = _Link(process, conn)
        self._finalizer = weakref.finalize(self, _shutdown, self._link)  # close(), or at exit

    def close(self) -> None:
        """Stop the writer process. A save still in flight (not waited on: the loop raised) is
        abandoned: the process is killed and its folder, without DONE, is not a checkpoint."""
        if self._finalizer is not None:
            self._finalizer()


def _send(link: _Link, request: _Request, fd: int | None, errors: list) -> None:
    try:
        link.conn.send(request)
        if fd is not None:
            multiprocessing.reduction.send_handle(link.conn, fd, link.process.pid)
    except BaseException as e:  # re-raised by result() in the training thread
        errors.append(e)


def _shutdown(link: _Link) -> None:
    if link.busy:
        link.process.kill()
    else:
        with contextlib.suppress(OSError):
            link.conn.send(None)  # the writer's loop ends, its group is destroyed
    try:
        link.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        link.process.kill()
        link.process.wait()
    link.conn.close()


def _meeting_point(control: ControlPlane) -> tuple[str, int, str, bool] | None:
    """Where the writer processes form their group: (host, port, key prefix, rank 0 hosts the
    store). The job's own rendezvous store (a TCPStore under the default group's) when every rank
    has one: no new port to open between hosts; else a store rank 0's writer hosts on a free port
    at MASTER_ADDR (or this host's name), as DCP's process-based async save does. None alone."""
    if control.world == 1:
        return None
    store: Any = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    own = control.any_flag(not isinstance(store, dist.TCPStore))
    prefix = control.broadcast(f"codex-checkpoint-writers/{uuid.uuid4().hex}/")
    if not own:
        assert isinstance(store, dist.TCPStore)
        return store.host, store.port, prefix, False
    host = os.environ.get("MASTER_ADDR") or socket.getfqdn()
    return control.broadcast((host, _free_port(), prefix, True) if control.rank == 0 else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _exit_with_parent(parent_pid: int) -> None:
    """The writer never outlives its trainer: a killed job leaves no process behind, and a save it
    was writing has no DONE."""
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    os._exit(1)


def _writer_control(rank: int, world: int, meet) -> ControlPlane:
    if meet is None:
        return ControlPlane()
    host, port, prefix, own = meet
    timeout = datetime.timedelta(seconds=CONTROL_TIMEOUT_S)
    store = dist.TCPStore(host, port, world, is_master=own and rank == 0, timeout=timeout)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, timeout=timeout
    )
    return ControlPlane(dist.group.WORLD, rank, world)


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


# The writer process's first lines: codex's packages are found through the trainer's sys.path.
_WRITER_MAIN = (
    "import sys, multiprocessing.connection as c; conn = c.Connection(int(sys.argv[1])); "
    "sys.path[:] = conn.recv(); from codex.train.checkpoint.async_save import serve_writer; "
    "serve_writer(conn, *conn.recv())"
)


def serve_writer(conn, rank: int, world: int, meet, parent_pid: int) -> None:
    """The writer process: map each new staging buffer, and for each request run the checkpoint
    protocol (commit) with write_staged as its write, replying (its pid, the error or None)."""
    # It copies nothing to or from a GPU: no CUDA context (memory on the device, DCP's GPU loader)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    control: ControlPlane | None = None
    failed: BaseException | None = None
    try:
        control = _writer_control(rank, world, meet)
    except BaseException as e:  # every request gets it
        failed = _picklable(e)
    plan: dcp_io.StagedPlan | None = None
    views: list[torch.Tensor] = []
    while True:
        try:
            request = conn.recv()
        except EOFError:
            break
        if request is None:
            break
        if request.plan is not None:
            fd = multiprocessing.reduction.recv_handle(conn)
            plan, views = request.plan, []  # the old mapping goes first
            with os.fdopen(fd, "rb") as f:
                buffer = mmap.mmap(f.fileno(), max(plan.nbytes, 1))
            views = dcp_io.buffer_views(buffer, plan.slots)
        error = failed
        if error is None:
            assert control is not None and plan is not None
            write = functools.partial(dcp_io.write_staged, plan=plan, views=views, control=control)
            try:
                commit(request.run, request.step, request.tree, write, control, request.keep)
            except BaseException as e:
                error = _picklable(e)
        conn.send((os.getpid(), error))
    if control is not None and control.world > 1:
        dist.destroy_process_group()
