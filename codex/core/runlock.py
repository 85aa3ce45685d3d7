"""One writer per run directory: a lease file, RUN/.codex-lock.json, local or on gs://.

Two `codex train` on one run directory would resume from each other's checkpoints, overwrite each
other's files and both exit 0. So every command that writes a run holds the lease while it runs;
a second writer is refused (LockHeld, a ConfigError: exit 2) with a line naming the holder. A
stale lease (its pid dead on this host, or its heartbeat older than STALE_AFTER_S) is taken over
with a warning. Every change is atomic and conditional: flock locally, generation preconditions
on gs://. docs/bad-input.md, "One writer per run directory", has the details.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid

from codex.core import fsio
from codex.core.config import ConfigError

log = logging.getLogger("codex.core.runlock")

LEASE_NAME = ".codex-lock.json"
STALE_AFTER_S = 120.0  # a heartbeat older than this marks the holder dead
HEARTBEAT_S = 15.0  # how often the holder refreshes it (8 chances before it goes stale)
EXIT_LOST = 3  # exit status of a holder whose lease was taken over


class LockHeld(ConfigError):
    """Another live process holds the run directory (the CLI exits 2 with this line)."""


class LockLost(RuntimeError):
    """Our lease was taken over while we ran (we stalled past STALE_AFTER_S)."""


def _now_utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:  # a killed process nobody has reaped yet (a zombie) is gone too
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def stale_reason(
    lease: dict | None, stale_after: float = STALE_AFTER_S, now: float | None = None
) -> str | None:
    """Why `lease` may be taken over, or None while its holder looks alive."""
    if lease is None:
        return "the lease file is unreadable"
    now = time.time() if now is None else now
    if lease.get("host") == socket.gethostname() and not _pid_alive(int(lease.get("pid", -1))):
        return f"its process {lease.get('pid')} is no longer running on this host"
    age = now - float(lease.get("heartbeat", 0))
    if age > stale_after:
        return f"its last heartbeat was {age:.0f} s ago (more than {stale_after:.0f} s)"
    return None


def _dumps(lease: dict) -> bytes:
    return (json.dumps(lease, indent=2, sort_keys=True) + "\n").encode()


def describe(lease: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    return (
        f"`{lease.get('command', '?')}` "
        f"(pid {lease.get('pid', '?')} on host {lease.get('host', '?')}, "
        f"since {_now_utc(float(lease.get('started', 0)))}, "
        f"last heartbeat {max(0.0, now - float(lease.get('heartbeat', 0))):.0f} s ago)"
    )


# --- storage: the same four atomic operations locally and on GCS ---------------------------------
# read() -> (lease or None when unreadable, version or None when absent); create/swap return the
# new version, or None when the lease was not absent / not at `version` any more.


class _LocalLease:
    """A lease file guarded by flock on `<lease>.guard`; version = the holder's token."""

    def __init__(self, path: str):
        self.path = path
        self.guard_path = path + ".guard"
        self._mutex = threading.Lock()  # one guard at a time within this object's threads

    @contextlib.contextmanager
    def _guard(self):
        with self._mutex:
            while True:
                fd = os.open(self.guard_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
                fcntl.flock(fd, fcntl.LOCK_EX)
                # the releaser unlinks the guard: a lock on a file no longer at that path guards
                # nothing
                try:
                    st, now = os.fstat(fd), os.stat(self.guard_path)
                    if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                        break
                except FileNotFoundError:
                    pass
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            try:
                yield
            finally:
                # explicit unlock: a child forked meanwhile shares the open file and would keep it
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def _read(self) -> tuple[dict | None, str | None]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None, None
        try:
            lease = json.loads(raw)
            return lease, str(lease["token"])
        except (ValueError, KeyError, TypeError):
            return None, "unreadable"

    def read(self):
        with self._guard():
            return self._read()

    def create(self, lease: dict) -> str | None:
        with self._guard():
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                return None
            with os.fdopen(fd, "wb") as f:
                f.write(_dumps(lease))
                f.flush()
                os.fsync(f.fileno())
            return lease["token"]

    def swap(self, version: str, lease: dict) -> str | None:
        with self._guard():
            if self._read()[1] != version:
                return None
            fsio.write_bytes(self.path, _dumps(lease))  # temp file + fsync + os.replace
            return lease["token"]

    def delete(self, version: str) -> bool:
        with self._guard():
            if self._read()[1] != version:
                return False
            os.unlink(self.path)
            os.unlink(self.guard_path)  # still flocked: later guards see it gone and start afresh
            return True


class _GcsLease:
    """One object; version = its generation; every write carries an ifGenerationMatch precondition.

    gcsfs's own writers only offer ifGenerationMatch=0 (mode="create"), so the uploads go through
    its JSON API session (`fs.call`); gcsfs turns the 412 of a failed precondition into
    FileExistsError.
    """

    def __init__(self, url: str):
        self.url = url
        self.fs, path = fsio.filesystem(url)
        self.bucket, self.key = path.split("/", 1)

    def read(self):
        try:
            meta = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, json_out=True)
            # the body of exactly that generation (404 if it changed since: read again)
            _, body = self.fs.call(
                "GET",
                "b/{}/o/{}",
                self.bucket,
                self.key,
                alt="media",
                generation=meta["generation"],
            )
        except FileNotFoundError:
            return None, None
        try:
            return json.loads(body), str(meta["generation"])
        except ValueError:
            return None, str(meta["generation"])

    def _upload(self, lease: dict, if_generation: str) -> str | None:
        try:  # text/plain: the GCS emulator parses an application/json upload body and hangs up
            out = self.fs.call(
                "POST",
                f"{self.fs._location}/upload/storage/v1/b/{self.bucket}/o",
                uploadType="media",
                name=self.key,
                ifGenerationMatch=if_generation,
                data=_dumps(lease),
                headers={"Content-Type": "text/plain"},
                json_out=True,
            )
        except FileExistsError:  # 412: someone else changed it first
            return None
        return str(out["generation"])

    def create(self, lease: dict) -> str | None:
        return self._upload(lease, "0")

    def swap(self, version: str, lease: dict) -> str | None:
        return self._upload(lease, version)

    def delete(self, version: str) -> bool:
        try:
            self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=version)
            return True
        except (FileExistsError, FileNotFoundError):
            return False


# --- the lock ------------------------------------------------------------------------------------


class RunLock:
    """Hold `folder`'s lease while the block runs: `with RunLock(run, "codex train"): ...`.

    acquire() raises LockHeld when a live process holds it and takes a stale lease over with a
    warning; release() (on leaving the block, or at exit) deletes it only while it is still ours.
    """

    def __init__(
        self,
        folder: str,
        command: str,
        lease_name: str = LEASE_NAME,
        stale_after: float = STALE_AFTER_S,
        heartbeat: float = HEARTBEAT_S,
        on_lost=None,
    ):
        self.folder, self.command = str(folder), command
        self.path = fsio.join(self.folder, lease_name)
        self.stale_after, self.heartbeat_s = stale_after, heartbeat
        self.on_lost = on_lost or _exit_lost
        self._store = _GcsLease(self.path) if fsio.is_remote(self.path) else _LocalLease(self.path)
        self._version: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._made_folder = False
        self.lease: dict = {}

    def _new_lease(self) -> dict:
        now = time.time()
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "command": self.command,
            "argv": " ".join(sys.argv)[:500],
            "started": now,
            "started_utc": _now_utc(now),
            "heartbeat": now,
            "token": uuid.uuid4().hex,
        }

    def acquire(self) -> RunLock:
        local = not fsio.is_remote(self.folder)
        if local and os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise ConfigError(f"{self.folder}: not a directory (a file is there): name a folder")
        self._made_folder = local and not os.path.isdir(self.folder)
        if self._made_folder:
            os.makedirs(self.folder, exist_ok=True)
        self.lease = self._new_lease()
        for _ in range(5):  # a pass fails only when another writer's change landed in between
            current, version = self._store.read()
            if version is None:
                self._version = self._store.create(self.lease)
            else:
                reason = stale_reason(current, self.stale_after)
                if reason is None:
                    raise LockHeld(
                        f"{self.folder} is in use by {describe(current)}; wait for it to finish "
                        f"or stop it. A lock whose process has died, or whose heartbeat is older "
                        f"than {self.stale_after:.0f} s, is taken over automatically ({self.path})"
                    )
                self._version = self._store.swap(version, self.lease)
            if self._version or self._is_mine():
                if version is not None:
                    log.warning(
                        "taking over the stale lock %s of %s: %s",
                        self.path,
                        describe(current) if current else "an unknown holder",
                        reason,
                    )
                break
        else:
            raise LockHeld(
                f"{self.folder}: could not take the lock {self.path}; "
                "other writers keep changing it"
            )
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._beat, name="codex-runlock-heartbeat", daemon=True
        )
        self._thread.start()
        return self

    def _is_mine(self) -> bool:
        """Whether the lease holds our token (a retried request may report 412 for our own
        write)."""
        current, version = self._store.read()
        if current is not None and current.get("token") == self.lease["token"]:
            self._version = version
            return True
        return False

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.refresh()
            except LockLost as e:
                self.on_lost(self, e)
                return
            except Exception as e:  # noqa: BLE001 - transient: the next beat retries; stale only after STALE_AFTER_S
                log.warning(
                    "run lock %s: heartbeat failed (%s); retrying in %.0f s",
                    self.path,
                    e,
                    self.heartbeat_s,
                )

    def refresh(self) -> None:
        """Write a new heartbeat, only while the lease is still ours; LockLost otherwise."""
        assert self._version is not None  # set by acquire(), which starts the heartbeat
        lease = dict(self.lease, heartbeat=time.time())
        version = self._store.swap(self._version, lease)
        if version is None:
            if not self._is_mine():
                current, _ = self._store.read()
                raise LockLost(
                    f"{self.path} was taken over by "
                    f"{describe(current) if current else 'another writer'}"
                )
            # our retried write had landed: once more
            version = self._store.swap(self._version, lease)
            if version is None:
                raise LockLost(f"{self.path} keeps changing under its holder")
        self.lease, self._version = lease, version

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._thread = None
        if self.lease.get("pid") != os.getpid():
            return  # a forked child never releases its parent's lease
        assert self._version is not None  # set by acquire(), which started the heartbeat thread
        try:
            if not self._store.delete(self._version) and self._is_mine():
                self._store.delete(self._version)
            # a command that failed at once leaves no empty run directory behind
            if self._made_folder:
                with contextlib.suppress(OSError):
                    os.rmdir(self.folder)
        except Exception as e:  # noqa: BLE001 - the next writer finds it stale
            log.warning(
                "run lock %s: could not release it (%s); the next run takes it over once stale",
                self.path,
                e,
            )

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _exit_lost(lock: RunLock, err: Exception) -> None:
    log.error(
        "run lock lost: %s. Stopping now so that two writers never share %s", err, lock.folder
    )
    logging.shutdown()
    os._exit(EXIT_LOST)


# --- who holds it --------------------------------------------------------------------------------


def process_index(hosts: int = 1) -> int:
    """This process's index in its job: torchrun's RANK, a TPU slice's worker id, else 0.

    On a multi-host TPU slice every host runs the same command and none of these variables may be
    set, so the worker id is read the way torch_xla does (the TPU VM's metadata), without starting
    the XLA runtime. -1 when it cannot be told: that host then holds no lease. `hosts`: how many
    hosts the job's hardware preset spans.
    """
    for var in ("RANK", "CLOUD_TPU_TASK_ID", "TPU_WORKER_ID"):
        value = os.environ.get(var, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ConfigError(
                    f"environment variable {var}={value!r} is not an integer"
                ) from None
    if hosts > 1 and os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        try:
            from torch_xla._internal import tpu

            return int(tpu.worker_id())
        except Exception as e:  # noqa: BLE001 - any failure: say so, hold no lease
            log.warning(
                "run lock: cannot tell this TPU host's worker id (%s); this host takes no lock", e
            )
            return -1
    return 0


class _Held(contextlib.AbstractContextManager):
    """RunLock as a context manager that is also released at interpreter exit (atexit)."""

    def __init__(self, lock: RunLock):
        self.lock = lock

    def __enter__(self) -> RunLock:
        import atexit

        self.lock.acquire()
        atexit.register(self.lock.release)
        return self.lock

    def __exit__(self, *exc) -> None:
        import atexit

        self.lock.release()
        atexit.unregister(self.lock.release)


def hold(folder: str, command: str, lease_name: str = LEASE_NAME, hosts: int = 1):
    """A context manager holding `folder`'s lease in process 0 of the job; a no-op in the others.
    `hosts`: how many hosts the job spans (a multi-host TPU slice's worker id decides process 0)."""
    if process_index(hosts) != 0:
        return contextlib.nullcontext()
    return _Held(RunLock(folder, command, lease_name=lease_name))
