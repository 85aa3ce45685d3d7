"""Checkpoints: RUN/checkpoints/step_NNNNNNNN/ in torch.distributed.checkpoint's (DCP) format,
written by every rank in parallel, local or gs://:

    __R_N.distcp   the tensors rank R wrote: its shards (fsdp), or its share of the replicated ones
    .metadata      DCP's index of every tensor's chunks (rank 0)
    state.json     everything else (step, tokens, loader position, config, optimizer
                   hyperparameters, the unfinished loss window) and every tensor's shape and dtype
                   (rank 0)
    DONE           written last, by rank 0, once every rank has finished: the step and each file's
                   size and sha256 ({"step", "world_size", "files": {name: {"bytes", "sha256"}}})

One format for every layout: a checkpoint written by 2 fsdp ranks loads on 1 process or under
replicate, and the reverse (DCP reads each tensor into whatever layout the target has). Nothing in
a checkpoint is unpickled but DCP's index (.metadata), and that through an unpickler that allows
only DCP's metadata classes (dcp.py: _MetadataUnpickler): tensors come from DCP (weights only), the
rest from JSON. Single-file checkpoints of
older codex versions (ckpt.pt) are not readable: they count as damaged, with a message saying so.

A checkpoint counts only once DONE exists. `damage(folder, rank, world)` checks every world-th
file against DONE's size and sha256 (train/checkpoint/resume.py splits the files over the ranks),
`newest_intact(run)` walks back over damaged checkpoints with a warning, and an I/O error is retried
and then raised (never a silent fallback). `load(run, step)` returns a plain dict of full CPU
tensors in one process (eval, sample, export). Retention: the last `keep_last`, plus every step
that is a multiple of `keep_every` (when > 0); the rest is deleted after a save. The training
state itself is built and put back in train/checkpoint/state.py.

train.async_save: `save_in_background` copies what this rank writes into a buffer kept across
saves and hands it to this rank's `BackgroundWriter` process, which runs the same protocol (files,
then state.json and DONE by rank 0 once every rank has written, then retention) while training
goes on.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import logging
import mmap
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import re
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

from codex.core import fsio, rundir
from codex.train.checkpoint import dcp as dcp_io
from codex.train.distributed.control import CONTROL_TIMEOUT_S, ControlPlane

log = logging.getLogger("codex.checkpoint")

STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"step_(\d{8,})$")


def step_dir(run: str, step: int) -> str:
    return fsio.join(rundir.checkpoints_dir(run), f"step_{step:08d}")


def _all_steps(run: str) -> list[tuple[int, str]]:
    """(step, dir) of every step_* folder, complete or not, oldest first."""
    return _all_steps_in(rundir.checkpoints_dir(run))


def _all_steps_in(ckpt_dir: str) -> list[tuple[int, str]]:
    out = []
    for path in fsio.listdir(ckpt_dir):
        m = _STEP_DIR.search(path.rstrip("/"))
        if m:
            out.append((int(m.group(1)), path.rstrip("/")))
    return sorted(out)


def complete_steps(run: str) -> list[int]:
    """Steps whose DONE marker exists, oldest first."""
    return [s for s, d in _all_steps(run) if fsio.exists(fsio.join(d, "DONE"))]


def latest_step(run: str) -> int | None:
    """The newest step with a DONE marker (load() also checks the file is intact), or None."""
    steps = complete_steps(run)
    return steps[-1] if steps else None


def save(run: str, state: dict, keep_last: int = 3, keep_every: int = 0, control=None) -> str:
    """Write `state` (a nested dict that holds "step"; tensors in dicts, the rest JSON) as the
    checkpoint of that step, then DONE, then prune old ones. Every rank of `control` (a
    ControlPlane; None = this process alone) calls it with its own state: each writes its own
    tensors, rank 0 the rest. Returns the checkpoint folder."""
    control = control or ControlPlane()

    def write(folder: str) -> dict[str, dict]:
        return dcp_io.write_tree(folder, state, control)

    step, tree = int(state["step"]), dcp_io.skeleton(state)
    return _commit(run, step, tree, write, control, (keep_last, keep_every))


def _commit(run: str, step: int, tree: dict, write, control, keep: tuple[int, int]) -> str:
    """The checkpoint protocol around `write(folder)` (every rank's tensors, returning its file
    records): a clean folder, then the tensors, then rank 0 writes state.json (from every rank's
    skeleton `tree`) and DONE once every rank has finished, and prunes."""
    folder = step_dir(run, step)
    if control.rank == 0 and fsio.exists(folder):
        # a leftover of a killed save (or a damaged one): start clean
        fsio.rm(folder, recursive=True)
    control.barrier()
    records = write(folder)
    all_records = control.gather(records)
    # other ranks may hold keys rank 0 has not (their RNG)
    skeletons = control.gather(tree)
    if control.rank == 0:
        tree = skeletons[0]
        for extra in skeletons[1:]:
            tree = dcp_io.merge(tree, extra)
        data = json.dumps(tree).encode()
        fsio.write_bytes(fsio.join(folder, STATE_FILE), data)
        files = {STATE_FILE: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
        for r in all_records:
            files.update(r)
        fsio.write_json(
            fsio.join(folder, "DONE"), {"step": step, "world_size": control.world, "files": files}
        )
        drop_newer(run, step)
        prune(run, *keep)
    control.barrier()  # nobody goes on (or exits) before the marker exists
    return folder


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
    rendezvous store, for DCP's collectives and the blocking save's protocol (`_commit`: DONE
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
    "sys.path[:] = conn.recv(); from codex.train.checkpoint.folders import serve_writer; "
    "serve_writer(conn, *conn.recv())"
)


def serve_writer(conn, rank: int, world: int, meet, parent_pid: int) -> None:
    """The writer process: map each new staging buffer, and for each request run the checkpoint
    protocol (_commit) with write_staged as its write, replying (its pid, the error or None)."""
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
                _commit(request.run, request.step, request.tree, write, control, request.keep)
            except BaseException as e:
                error = _picklable(e)
        conn.send((os.getpid(), error))
    if control is not None and control.world > 1:
        dist.destroy_process_group()


def drop_newer(run: str, step: int) -> None:
    """Delete checkpoints newer than `step`, the one just written. They belong to a timeline this
    run did not resume from: resume takes the newest intact checkpoint, so a newer one was damaged
    (or unreadable). Kept, it would count towards keep_last and push out the intact ones."""
    for s, d in _all_steps(run):
        if s > step:
            log.warning(
                "deleting %s: newer than the checkpoint just written (step %d), so it was not "
                "resumed from (damaged or unreadable)",
                d,
                step,
            )
            fsio.rm(d, recursive=True)


def prune(run: str, keep_last: int, keep_every: int = 0) -> None:  # noqa: D401 - see the module docstring
    """Delete complete checkpoints beyond the last `keep_last` (except multiples of keep_every), and
    incomplete folders older than the newest complete one (leftovers of a killed save)."""
    complete = complete_steps(run)
    if not complete:
        return
    keep = set(complete[-max(1, keep_last) :])
    if keep_every > 0:
        keep |= {s for s in complete if s % keep_every == 0}
    for s, d in _all_steps(run):
        done = s in complete
        if (done and s not in keep) or (not done and s < complete[-1]):
            fsio.rm(d, recursive=True)


FAULT_ENV = "CODEX_TEST_FAIL_CKPT_READ_RANK"  # tests: this RANK cannot read the newest checkpoint


def _injected_fault(folder: str) -> None:
    rank = os.environ.get(FAULT_ENV)
    if rank is not None and rank == os.environ.get("RANK", "0"):
        run_ckpts = os.path.dirname(folder.rstrip("/"))
        newest = max(
            (s for s, d in _all_steps_in(run_ckpts) if fsio.exists(fsio.join(d, "DONE"))),
            default=None,
        )
        if newest is not None and folder.rstrip("/").endswith(f"step_{newest:08d}"):
            raise OSError(f"{folder}: injected read fault on rank {rank} ({FAULT_ENV})")


def _damage(folder: str, rank: int, world: int) -> str | None:
    """What is damaged in this rank's share (every world-th file) of a complete checkpoint, or None.
    A file that is missing, has another size or another sha256 than DONE recorded is damage; any
    other OSError (a storage hiccup) is raised."""
    _injected_fault(folder)
    try:
        done = fsio.read_json(fsio.join(folder, "DONE"))
    except ValueError as e:
        return f"{folder}/DONE: not JSON ({e})"
    if not isinstance(done, dict):
        return f"{folder}/DONE: not a JSON object ({type(done).__name__})"
    files = done.get("files")
    if not isinstance(files, dict):
        return (
            f"{folder}: a single-file checkpoint of an older codex (no file list in DONE); "
            "this version reads only distributed (DCP) checkpoints: start a new --run"
        )
    for name in sorted(files)[rank::world]:
        path, want = fsio.join(folder, name), files[name]
        if not (isinstance(want, dict) and {"bytes", "sha256"} <= set(want)):
            return f"{folder}/DONE: its entry for {name} has no 'bytes' and 'sha256'"
        try:
            actual = fsio.size(path)
            if actual != want["bytes"]:
                return (
                    f"{path}: {actual} bytes, DONE says {want['bytes']} (truncated or overwritten)"
                )
            if fsio.file_sha256(path) != want["sha256"]:
                return f"{path}: its sha256 is not the one DONE recorded (overwritten or corrupt)"
        except FileNotFoundError:
            return f"{path}: missing (DONE lists it)"
    return None


READ_RETRIES = (1.0, 4.0)  # seconds to wait before the 2nd and 3rd try of an I/O error


def damage(folder: str, rank: int = 0, world: int = 1) -> str | None:
    """_damage, with an I/O error (a storage hiccup, not a damaged file) retried and then raised: a
    fallback to an older checkpoint would make the next save delete this intact newer one
    (drop_newer), so a checkpoint that cannot be read right now is an error, not damage."""
    for wait in (*READ_RETRIES, None):
        try:
            return _damage(folder, rank, world)
        except OSError as e:
            if wait is None:
                raise OSError(
                    f"{folder}: could not read the newest checkpoint ({e}); not falling back to an "
                    "older one (that would discard this one): fix the storage error and rerun"
                ) from e
            log.warning("reading %s failed (%s); retrying in %.0f s", folder, e, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def newest_intact(run: str) -> int:
    """The newest complete checkpoint step whose files are all intact (one process checks them
    all); a damaged newer one is skipped with a warning. FileNotFoundError when there is none,
    ValueError when every one is damaged."""
    errors: list[str] = []
    for s in reversed(complete_steps(run)):
        problem = damage(step_dir(run, s))
        if problem is None:
            if errors:
                log.warning("using %s instead of the newest checkpoint", step_dir(run, s))
            return s
        log.warning(
            "checkpoint %s is damaged (%s); trying the previous one", step_dir(run, s), problem
        )
        errors.append(problem)
    if errors:  # bad data (exit 1), not a missing input
        raise ValueError(
            f"no intact checkpoint under {rundir.checkpoints_dir(run)}: every complete one is "
            f"damaged ({'; '.join(errors)})"
        )
    raise FileNotFoundError(f"no intact checkpoint under {rundir.checkpoints_dir(run)} (none yet)")


def read_skeleton(folder: str) -> dict:
    """state.json: the checkpoint's tree, tensors as {"__tensor__": shape, "dtype"}
    (train/checkpoint/dcp.py)."""
    return fsio.read_json(fsio.join(folder, STATE_FILE))


def load(run: str, step: int | str = "latest", keys: tuple[str, ...] | None = None) -> dict:
    """The checkpoint at `step` (or the newest intact one for "latest") as one plain dict of full
    CPU tensors, in this process alone, whatever layout and world size wrote it. `keys`: load only
    these top-level tensor subtrees (e.g. ("model",) for eval); the non-tensor values always come.

    "latest" skips (with a warning) a newest checkpoint with a damaged file and uses the one
    before; an explicit step that is damaged is an error. FileNotFoundError when none."""
    if step == "latest":
        step = newest_intact(run)
    else:
        step = int(step)
        folder = step_dir(run, step)
        if not fsio.exists(fsio.join(folder, "DONE")):
            raise FileNotFoundError(
                f"{folder}: no complete checkpoint (have steps: {complete_steps(run) or 'none'})"
            )
        problem = damage(folder)
        if problem is not None:
            raise ValueError(f"{folder}: not a readable checkpoint ({problem})")
    folder = step_dir(run, step)
    tree = read_skeleton(folder)
    if keys is not None:
        tree = {k: v for k, v in tree.items() if k in keys or not _holds_tensors(v)}
    state = dcp_io.targets_from_skeleton(tree)
    dcp_io.read_tensors(folder, state)
    return state


def _holds_tensors(tree) -> bool:
    if dcp_io.is_tensor_leaf(tree):
        return True
    return isinstance(tree, dict) and any(_holds_tensors(v) for v in tree.values())


def rng_state() -> dict:
    """RNG states as tensors (weights_only-loadable): torch CPU, and every CUDA device's."""
    state: dict = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # tensors in dicts
        state["cuda"] = {str(i): t for i, t in enumerate(torch.cuda.get_rng_state_all())}
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([state["cuda"][k] for k in sorted(state["cuda"], key=int)])
