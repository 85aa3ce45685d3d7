"""The host's local cache of gs:// shards: one folder shared by every process on the host.

Each shard is downloaded once per host however many ranks read it, and no process deletes a file
another one is about to open. fcntl.flock on two lock files per shard (CACHE/locks/NAME.lock and
NAME.dl) does both, and the kernel drops a crashed rank's locks. Cached names carry the manifest's
sha256 prefix, so a file with other contents is never taken for the current one. The protocol,
step by step: docs/training.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading

from codex.core import fsio


class HostShardCache:
    """Shards `remote_paths` of one split in `folder`, at most about `bound` files of this split.

    acquire(i) -> local path, held by this process until release(i) (or close()).
    `fetched` lists the shards this process downloaded, in order (the others were on disk already).
    Thread-safe: the download pool acquires several shards at once."""

    def __init__(
        self, folder: str, split: str, remote_paths: list[str], sha256: list[str | None], bound: int
    ):
        self.folder, self.split, self.bound = folder, split, max(1, int(bound))
        self.remote_paths, self.sha256 = list(remote_paths), list(sha256)
        self.lock_dir = os.path.join(folder, "locks")
        os.makedirs(self.lock_dir, exist_ok=True)
        self.held: dict[int, int] = {}  # shard -> fd of its lock file, holding a shared lock
        self.fetched: list[int] = []
        self.closed = False
        self._mutex = threading.Lock()

    def name(self, i: int) -> str:
        tag = (self.sha256[i] or "")[:16] or f"{i:05d}"
        return f"{self.split}_{tag}_{fsio.basename(self.remote_paths[i])}"

    def path(self, i: int) -> str:
        return os.path.join(self.folder, self.name(i))

    def _lock_fd(self, name: str, kind: str = ".lock") -> int:
        return os.open(os.path.join(self.lock_dir, name + kind), os.O_RDWR | os.O_CREAT, 0o666)

    def holds(self, i: int) -> bool:
        with self._mutex:
            return i in self.held

    def held_ids(self) -> list[int]:
        with self._mutex:
            return list(self.held)

    def acquire(self, i: int) -> str:
        """Hold shard i, downloading it first if no process on the host has; returns its path."""
        final = self.path(i)
        if self.holds(i):
            return final
        fd = self._lock_fd(self.name(i))
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if not os.path.exists(final):
                dl = self._lock_fd(self.name(i), ".dl")
                try:
                    fcntl.flock(dl, fcntl.LOCK_EX)  # one downloader per host; the others wait here
                    if not os.path.exists(final):
                        self._download(i, final)
                finally:
                    os.close(dl)
            os.utime(final)  # most recently used: evicted last
        except BaseException:
            os.close(fd)
            raise
        with self._mutex:
            if self.closed or i in self.held:  # closed meanwhile, or another thread got it first
                os.close(fd)
            else:
                self.held[i] = fd
        return final

    def _download(self, i: int, final: str) -> None:
        # Called under the exclusive NAME.dl lock, so the temp name is this shard's alone on the
        # host.
        tmp = os.path.join(self.folder, f".part-{self.name(i)}")
        fsio.download(self.remote_paths[i], tmp)
        want = self.sha256[i]
        if want and fsio.file_sha256(tmp) != want:
            os.unlink(tmp)
            raise ValueError(
                f"{self.remote_paths[i]}: sha256 does not match the manifest ({want}); "
                "the shard changed after `codex data shard`"
            )
        os.replace(tmp, final)
        with self._mutex:
            self.fetched.append(i)

    def release(self, i: int) -> None:
        with self._mutex:
            fd = self.held.pop(i, None)
        if fd is not None:
            os.close(fd)  # drops the shared lock

    def evict(self) -> None:
        """Delete this split's least recently used files that no process holds, down to the
        bound."""
        prefix = self.split + "_"
        files = []
        with os.scandir(self.folder) as it:
            for e in it:
                if e.name.startswith(prefix):
                    # another process evicted it just now
                    with contextlib.suppress(FileNotFoundError):
                        files.append((e.stat().st_mtime, e.name))
        excess = len(files) - self.bound
        if excess <= 0:
            return
        with self._mutex:
            mine = {self.name(i) for i in self.held}
        for _, name in sorted(files):
            if excess <= 0:
                break
            if name in mine:
                continue
            fd = self._lock_fd(name)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # some process holds it (or is downloading it): keep it
                os.close(fd)
                continue
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.folder, name))
                excess -= 1
            finally:
                os.close(fd)

    def close(self) -> None:
        with self._mutex:
            self.closed = True
            fds, self.held = list(self.held.values()), {}
        for fd in fds:
            os.close(fd)
