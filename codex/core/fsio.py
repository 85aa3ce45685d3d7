"""All file I/O in codex goes through here: local paths and any fsspec URL (gs://bucket/run).

Why one layer: every stage writes into the same run directory contract, locally or on GCS, and
every write must be atomic so that a killed job never leaves a half-written file under its final
name. Locally that is temp file + os.replace. On an object store an object only appears once its
upload has finished, so writing the final name directly is already atomic per object; a stage
that writes several objects marks completion by writing its manifest / marker object last. An
object is held locally and uploaded whole, again when the store loses it (codex/core/store.py).

GCS: install the `gcs` extra (gcsfs). Tests point gcsfs at a local emulator through
STORAGE_EMULATOR_HOST (see tests/conftest.py); nothing here knows about the emulator.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import posixpath
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, TypeVar

from codex.core import store

if TYPE_CHECKING:
    import fsspec

# gcsfs 2026.x probes every bucket's type over gRPC first and waits ~60 s when the server does not
# speak it (the emulator, some proxies); the probe only matters for zonal/HNS buckets. gcsfs reads
# this at import time, so it is set before anything imports gcsfs. setdefault: the user may opt in.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

log = logging.getLogger("codex.core.fsio")

T = TypeVar("T")
R = TypeVar("R")

RETRIES = 5  # attempts for a remote write hitting a transient error
# Every remote filesystem without fsspec's listing cache: gcsfs keeps each listing (every object's
# metadata, ~3 KB an entry) without expiry, per thread's instance; a driver that lists a folder of
# a million parts would hold gigabytes. codex lists a folder once where it needs to and keeps
# what it needs of it.
LISTING_OPTIONS = {"use_listings_cache": False}
# paths a remote batch deletion sends in one request (GCS's JSON API takes 100 a batch)
DELETE_BATCH = 100
SPOOL_BYTES = 64 << 20  # an object being written is held in memory up to this, then on local disk
# an object up to this is uploaded in one request; a bigger one through an upload session
SIMPLE_UPLOAD_BYTES = 8 << 20


def is_remote(path: str) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


def request_threads(paths: list) -> int:
    """Threads for one request per path: 16 on an object store, where each is a round trip of
    tens of ms; 1 on a local disk, where there is no wait to overlap."""
    return 16 if paths and is_remote(paths[0]) else 1


def map_requests(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    """[fn(x) for x in items], in order, on up to `threads` threads (fn is a request to storage:
    the threads wait on the network, not the GIL). Each thread takes runs of items, not one (a
    future an item would cost more than a local read). The first exception is raised."""
    threads = min(threads, len(items))
    if threads < 2:
        return [fn(x) for x in items]
    step = -(-len(items) // (4 * threads))  # 4 runs a thread: a slow run holds up little

    def run(start: int) -> list[R]:
        return [fn(x) for x in items[start : start + step]]

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return [r for rs in pool.map(run, range(0, len(items), step)) for r in rs]


def require_bucket(url: str) -> None:
    """A gs:// path's bucket must exist: FileNotFoundError naming it (an object store reports a
    missing bucket as a raw URL deep inside the first write otherwise). Skipped when this
    identity may not list buckets: the first real operation then says why."""
    if not str(url).startswith("gs://"):
        return
    bucket = str(url)[5:].split("/", 1)[0]
    fs, _ = filesystem(url)
    try:
        fs.info(bucket)  # not fs.exists: it answers False for any error, a network one included
        return
    except FileNotFoundError:
        pass
    except store.StoreError:  # the store itself does not answer: that is the line to show
        raise
    except Exception:  # no network, 403 on the bucket itself: not ours to judge here
        return
    raise FileNotFoundError(
        f"gs://{bucket}: no such bucket (check the name in {url}, or create it: "
        f"gcloud storage buckets create gs://{bucket})"
    )


def _strip_file(path: str) -> str:
    path = str(path)
    return path[len("file://") :] if path.startswith("file://") else path


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path within it). Remote filesystems are created with our retry/emulator
    options.

    fsspec is imported here, on first use, not with this module: the functions below answer a
    local path with os calls, so a process that only touches local files (a data stage's worker)
    starts without fsspec's imports (asyncio, ssl, importlib.metadata: ~80 ms a process)."""
    import fsspec

    path = _strip_file(path)
    if not is_remote(path):
        return fsspec.filesystem("file"), os.path.abspath(path)
    protocol = path.split("://", 1)[0]
    options: dict = {}
    if protocol in ("gs", "gcs"):
        endpoint = os.environ.get("STORAGE_EMULATOR_HOST")
        if endpoint:
            options = {"endpoint_url": endpoint, "token": "anon"}
        try:
            import gcsfs  # noqa: F401
        except ImportError as e:  # no silent fallback: say how to fix it
            raise RuntimeError(
                f"{path}: gs:// paths need gcsfs; install it with: pip install -e '.[gcs]'"
            ) from e
        from codex.core.gcs import BoundedGCSFileSystem

        kwargs = {**options, **LISTING_OPTIONS, **BoundedGCSFileSystem._get_kwargs_from_urls(path)}
        gcs = BoundedGCSFileSystem(**kwargs)
        return gcs, gcs._strip_protocol(path)
    # url_to_fs, not get_fs_token_paths: the latter expands globs (and fails on no match).
    fs, p = fsspec.core.url_to_fs(path, **options, **LISTING_OPTIONS)
    return fs, p


def join(base: str, *parts: str) -> str:
    base = str(base)
    if is_remote(base):
        return posixpath.join(base, *parts)
    return os.path.join(base, *parts)


def _url(fs: fsspec.AbstractFileSystem, path: str, like: str) -> str:
    """Put the protocol back on a path returned by fs.ls/glob, so callers get what they passed
    in."""
    if not is_remote(like):
        return path
    protocol = like.split("://", 1)[0]
    return path if "://" in path else f"{protocol}://{path}"


def _local(path: str) -> str | None:
    """The absolute local path for a local path or file:// URL; None for a remote URL."""
    return None if is_remote(path) else os.path.abspath(_strip_file(path))


def exists(path: str) -> bool:
    local = _local(path)
    if local is not None:
        return os.path.exists(local)
    fs, p = filesystem(path)
    return fs.exists(p)


def isdir(path: str) -> bool:
    local = _local(path)
    if local is not None:
        return os.path.isdir(local)
    fs, p = filesystem(path)
    return fs.isdir(p)


def makedirs(path: str) -> None:
    local = _local(path)
    if local is not None:  # object stores have no directories
        os.makedirs(local, exist_ok=True)


def listdir(path: str) -> list[str]:
    """Full paths of the entries directly under `path`, sorted; [] when it does not exist (a file:
    [that file], as fsspec's ls answers)."""
    local = _local(path)
    if local is not None:
        if os.path.isdir(local):
            return sorted(os.path.join(local, name) for name in os.listdir(local))
        return [local] if os.path.exists(local) else []
    fs, p = filesystem(path)
    if not fs.exists(p):
        return []
    return sorted(_url(fs, e, path) for e in fs.ls(p, detail=False))


def list_names(path: str) -> list[str]:
    """The names (not paths) of the entries directly under folder `path`, sorted; [] when there
    are none. A filesystem with `names_under` (codex/core/gcs.py) is asked a page of names at a
    time, without each object's metadata; any other through its ls."""
    local = _local(path)
    if local is not None:
        return sorted(os.listdir(local)) if os.path.isdir(local) else []
    fs, p = filesystem(path)
    names_under = getattr(fs, "names_under", None)
    if names_under is not None:
        return sorted(names_under(p))
    return [basename(e) for e in listdir(path) if e.rstrip("/") != path.rstrip("/")]


def spread(folder: str, name: str) -> str:
    """The name an object of a numbered series (a unit's part, marker, hash file) gets in
    `folder`: on an object store a short hash of the name first, so that series written at once
    spread over the bucket's key range (GCS splits a bucket's load by name ranges, and sequential
    names all land on the last; its guidelines ask for a hash prefix); a local folder keeps the
    name as it is. Readers find such objects through a marker or manifest, never by number."""
    if not is_remote(folder):
        return name
    return f"{hashlib.md5(name.encode()).hexdigest()[:4]}-{name}"


def join_inside(base: str, rel: str, where: str) -> str:
    """join(base, rel) for a path read from a file (a manifest entry): refused with a ValueError
    naming `where` when it is absolute, a URL, or climbs out of `base` with '..'. A manifest must
    never make codex read (or train on) a file outside the folder it describes."""
    parts = str(rel).replace("\\", "/").split("/")
    if (
        not rel
        or "://" in str(rel)
        or str(rel).startswith(("/", "~"))
        or ".." in parts
        or ":" in parts[0]
    ):
        raise ValueError(
            f"{where}: path {rel!r} is not inside {base} (absolute, a URL or '..'); "
            "shard paths must be relative to the manifest's folder"
        )
    return join(base, rel)


def basename(path: str) -> str:
    """The last component of a local path or URL ("gs://b/run/x.npy" -> "x.npy",
    "dir/" -> "dir")."""
    return posixpath.basename(path.replace(os.sep, "/").rstrip("/"))


def glob(pattern: str) -> list[str]:
    fs, p = filesystem(pattern)
    return sorted(_url(fs, e, pattern) for e in fs.glob(p))


def size(path: str) -> int:
    local = _local(path)
    if local is not None:
        return os.path.getsize(local)
    fs, p = filesystem(path)
    return int(fs.size(p))


def rm(path: str, recursive: bool = False) -> None:
    local = _local(path)
    if local is not None:
        if os.path.isdir(local) and not os.path.islink(local):
            if not recursive:
                raise ValueError(f"{local}: cannot delete a directory without recursive=True")
            shutil.rmtree(local)
        elif os.path.lexists(local):
            os.remove(local)
        return
    fs, p = filesystem(path)
    # one request, no existence check first: a missing object (never written, gone meanwhile,
    # a retried delete whose first try went through) is done all the same
    with contextlib.suppress(FileNotFoundError):
        fs.rm(p, recursive=recursive)


def rm_many(paths: Sequence[str], threads: int = 16) -> None:
    """rm each of `paths` (files; a missing one is done all the same). Remote: in batches of
    DELETE_BATCH paths a request (gcsfs sends a batch deletion as one request), the batches on
    up to `threads` threads."""
    if not paths:
        return
    if not is_remote(paths[0]):
        for path in paths:
            rm(path)
        return
    fs, _ = filesystem(paths[0])
    batches = [
        [fs._strip_protocol(p) for p in paths[i : i + DELETE_BATCH]]
        for i in range(0, len(paths), DELETE_BATCH)
    ]

    def delete(batch: list[str]) -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(batch)

    map_requests(delete, batches, threads)


def open(path: str, mode: str = "rb", **kwargs) -> IO:  # noqa: A001 - mirrors builtins.open
    """A file object; kwargs are fsspec's (compression="infer" reads .gz and .zst)."""
    local = _local(path)
    if local is not None and not kwargs:
        return builtins_open(local, mode)
    fs, p = filesystem(path)
    return fs.open(p, mode, **kwargs)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb") -> Iterator[IO]:
    """Write `path` so that readers see either the old file or the whole new one, never a part.

    Local: a temp file in the same directory, fsync, os.replace. Remote: the bytes are held
    (memory, then a local temp file) and uploaded at the end (put_object: atomic per object, its
    upload started over when the store loses it); on error nothing is uploaded.
    """
    assert mode in ("wb", "w"), mode
    if is_remote(path):
        with tempfile.SpooledTemporaryFile(SPOOL_BYTES) as spool:
            if mode == "wb":
                yield spool
            else:
                text = io.TextIOWrapper(spool, encoding="utf-8")  # type: ignore[arg-type]
                yield text
                text.detach()  # flushes it, leaves the spool open
            put_object(spool, path)  # type: ignore[arg-type]
        return
    path = os.path.abspath(_strip_file(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=".tmp-" + os.path.basename(path) + ".", dir=os.path.dirname(path)
    )
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; outputs get the usual permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


_UMASK = os.umask(0)
os.umask(_UMASK)


def open_up(folder: str) -> None:
    """Give a local folder made with tempfile (0700, its files often 0600) the permissions this
    process's umask gives anything else it creates, before it is renamed into place: a shared
    model directory stays readable by the group."""
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~_UMASK)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~_UMASK)


def write_bytes(path: str, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_bytes(path: str) -> bytes:
    """The whole file. Remote: one request (fsspec's cat_file), not an open's two (the object's
    metadata, then its bytes)."""
    local = _local(path)
    if local is not None:
        with builtins_open(local, "rb") as f:
            return f.read()
    fs, p = filesystem(path)
    return fs.cat_file(p)


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def read_json(path: str):
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from e


def upload(local_path: str, remote_path: str) -> None:
    """Copy a local file to any path, atomically (used by `codex data upload` and checkpoints)."""
    if is_remote(remote_path):
        with builtins_open(local_path, "rb") as src:
            put_object(src, remote_path)
        return
    with builtins_open(local_path, "rb") as src, atomic_open(remote_path, "wb") as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)


def put_object(src: IO[bytes], path: str) -> None:
    """Upload the whole of `src` (a seekable binary file) as object `path`, in one request up to
    SIMPLE_UPLOAD_BYTES; started over from src's first byte after a transient failure (the store
    lost the upload, a connection dropped), data.task.io_retries times at most (store.SETTINGS)."""

    def once() -> None:
        fs, p = filesystem(path)
        size = src.seek(0, os.SEEK_END)
        src.seek(0)
        if size <= SIMPLE_UPLOAD_BYTES:  # one request (gcsfs: a simple upload), not a session's two
            try:
                fs.pipe_file(p, src.read())
            except store.StoreUnreachable as e:
                raise store.writing(e, p.split("/", 1)[-1]) from e
            return
        f = fs.open(p, "wb")
        try:
            while chunk := src.read(8 << 20):
                f.write(chunk)
            f.close()  # the last chunk: the object appears now
        except BaseException:
            # never closed after an error: closing would commit what was sent as the object;
            # marked closed, so that no finaliser (gcsfs closes files it collects) commits it later
            with contextlib.suppress(Exception):
                f.discard()
            f.closed = True
            raise

    with_retries(once, f"upload of {path}", attempts=store.SETTINGS.io_retries + 1)


def download(remote_path: str, local_path: str) -> None:
    with open(remote_path, "rb") as src, atomic_open(local_path, "wb") as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)


# --- retries and hashing --------------------------------------------------------------------------


# OSErrors of a connection or a device that a second attempt may not meet (EIO: a FUSE mount's
# or a network filesystem's read that failed)
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO",
        "ECONNRESET",
        "ECONNABORTED",
        "ECONNREFUSED",
        "ETIMEDOUT",
        "EPIPE",
        "EAGAIN",
        "ENETDOWN",
        "ENETUNREACH",
        "ENETRESET",
        "EHOSTUNREACH",
        "EHOSTDOWN",
    )
    if hasattr(errno, name)
)


def is_transient(e: BaseException) -> bool:
    """Whether an error may go away on a second attempt: a dropped or timed-out connection, an
    EIO or ECONNRESET, HTTP 408/429/5xx (gcsfs' HttpError, aiohttp's, requests'), or an error
    raised from one of those (`raise ... from e`). A missing file, a refused permission or bad
    data is not: it fails the same way twice."""
    for cause in _causes(e):
        if isinstance(cause, store.StoreError):  # a lost upload starts over; a store gone for
            return isinstance(cause, store.UploadLost)  # good does not, whatever its cause
        if _transient_here(cause):
            return True
    return False


def is_store_failure(e: BaseException) -> bool:
    """Whether the storage failed, not the file: a transient error, or an object store that gave
    up (codex/core/store.py), or an error raised from one. A reader that skips a bad input must
    raise these instead."""
    return is_transient(e) or any(isinstance(c, store.StoreError) for c in _causes(e))


def _causes(e: BaseException | None) -> Iterator[BaseException]:
    """e, what it was raised from, and so on (8 at most)."""
    for _ in range(8):
        if e is None:
            return
        yield e
        e = e.__cause__


def _transient_here(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    code = getattr(e, "code", None) or getattr(e, "status", None)
    if isinstance(code, int) and 100 <= code < 600:  # an HTTP status
        return code in (408, 429) or code >= 500
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    module = type(e).__module__
    if module.startswith("gcsfs") and type(e).__name__ == "ChecksumError":
        return True  # the bytes arrived damaged: fetch them again
    return module.startswith(("aiohttp", "requests", "urllib3")) and not isinstance(e, ValueError)


def with_retries(fn, what: str, attempts: int = RETRIES, backoff_s: float = 1.0):
    """fn() with exponential backoff (backoff_s, twice that, ... up to 30 s) on transient errors
    (is_transient); anything else, or the last attempt's error, raises."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:
            if i == attempts - 1 or not is_transient(e):
                raise
            wait = min(backoff_s * 2.0**i, 30.0)
            log.warning(
                "%s: transient error (%s: %s); retry %d/%d in %.1fs",
                what,
                type(e).__name__,
                e,
                i + 1,
                attempts - 1,
                wait,
            )
            time.sleep(wait)


class HashingWriter:
    """File-like that hashes what passes through (np.save writes in chunks, no full copy)."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.n += len(b)
        return self.f.write(b)


class HashingReader:
    """File-like that hashes what is read through it (a shard is checked in one streaming pass)."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        b = self.f.read(n)
        self.sha.update(b)
        self.n += len(b)
        return b


def file_digests(path: str, *algorithms: str) -> list:
    """The hashlib digests of a local or gs:// file, read once in 8 MiB chunks, one per
    algorithm."""
    hashes = [hashlib.new(a) for a in algorithms]
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            for h in hashes:
                h.update(chunk)
    return hashes


def file_sha256(path: str) -> str:
    return file_digests(path, "sha256")[0].hexdigest()


import builtins as _builtins  # noqa: E402

builtins_open = _builtins.open
