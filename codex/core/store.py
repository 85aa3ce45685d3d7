"""How codex treats an object store (gs://) that fails: its settings (store_timeout_s, the retries
of an object's upload), its errors (one line naming the store, the object and what a rerun does)
and `retried`, the time-bound retry every request to it goes through (codex/core/gcs.py).
docs/bad-input.md has the details.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

log = logging.getLogger("codex.core.store")

T = TypeVar("T")

RERUN = "once it answers, rerun the same command: it resumes after the work already finished"


@dataclasses.dataclass
class StoreSettings:
    """This process's: set by the command (codex/cli/command.py) and in every unit's process."""

    timeout_s: float = 120.0  # store_timeout_s: Google's own storage client retries this long
    io_retries: int = 4  # data.task.io_retries: restarts more of one object's upload


SETTINGS = StoreSettings()


def configure(timeout_s: float | None = None, io_retries: int | None = None) -> None:
    """Set this process's store settings (None keeps one)."""
    if timeout_s is not None:
        SETTINGS.timeout_s = float(timeout_s)
    if io_retries is not None:
        SETTINGS.io_retries = int(io_retries)


@contextlib.contextmanager
def configured(timeout_s: float, io_retries: int) -> Iterator[None]:
    """These store settings while the block runs (a unit's, in whichever process runs it)."""
    before = dataclasses.replace(SETTINGS)
    configure(timeout_s, io_retries)
    try:
        yield
    finally:
        configure(before.timeout_s, before.io_retries)


class StoreError(OSError):
    """An object store failed a request for good; its message is the one line the user sees."""


class StoreUnreachable(StoreError):
    """Every request to a store failed or hung for store_timeout_s: final, not retried."""


class UploadLost(StoreError):
    """The store lost an object's upload session (a restart does): the upload starts over."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What one request touches, read from its URL: its bucket, object and upload session."""

    bucket: str
    name: str  # the object's name in the bucket; "" for a bucket-wide request
    session: bool  # a resumable upload's session URL (upload_id=)

    @classmethod
    def of(cls, url: str) -> Target:
        parts = urllib.parse.urlsplit(url)
        query = urllib.parse.parse_qs(parts.query)
        path = urllib.parse.unquote(parts.path)
        m = re.search(r"/b/([^/]+)(?:/o/?(.*))?$", path)
        bucket, name = (m.group(1), m.group(2) or "") if m else ("", "")
        name = query.get("name", [name])[0]
        return cls(bucket, name, "upload_id" in query)

    def __str__(self) -> str:
        store = f"gs://{self.bucket}" if self.bucket else "the object store"
        return f"{store}/{self.name}" if self.name else store


# bucket -> when its current run of failures began (time.monotonic); no entry: it answers
_FAILING_SINCE: dict[str, float] = {}


def _why(e: BaseException) -> str:
    """The error in a few words; a URL in it (gcsfs' 404 is the URL alone) cut to its host."""
    if isinstance(e, FileNotFoundError):
        return "HTTP 404"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = re.sub(r"\b\w+://([^/\s]+)\S*", r"\1", text)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _transient(e: BaseException) -> bool:
    """A raw error of one request that a second attempt may not meet (gcsfs' own list, 408/429/5xx,
    a dropped connection or a timeout)."""
    from gcsfs.retry import is_retriable

    if isinstance(e, FileNotFoundError | PermissionError | FileExistsError):
        return False
    code = getattr(e, "code", None) or getattr(e, "status", None)  # gcsfs' and aiohttp's
    if isinstance(code, int) and 400 <= code < 600:  # 501: the store has no such call at all
        return code in (408, 429) or (code >= 500 and code != 501)
    return is_retriable(e) or isinstance(e, ConnectionError | TimeoutError)


def _lost(target: Target, e: BaseException) -> UploadLost:
    return UploadLost(
        f"{target}: the object store lost this object's upload mid-flight ({_why(e)} on its "
        f"upload session, as after a restart of the store); {RERUN}"
    )


def _unreachable(target: Target, method: str, e: BaseException) -> StoreUnreachable:
    doing = "writing" if method.upper() in ("POST", "PUT", "PATCH", "DELETE") else "reading"
    store = f"gs://{target.bucket}" if target.bucket else "the object store"
    what = f" ({doing} {target.name})" if target.name else ""
    return StoreUnreachable(
        f"{store} did not answer for {SETTINGS.timeout_s:g} s (store_timeout_s){what}: "
        f"{_why(e)}; {RERUN}"
    )


def writing(e: StoreUnreachable, name: str) -> StoreUnreachable:
    """`e` naming the object `name` it was writing, for a request whose URL does not carry it (a
    simple upload names its object in the body)."""
    head, sep, rest = str(e).partition(" (store_timeout_s)")
    if not sep or rest.startswith(" ("):
        return e
    return StoreUnreachable(f"{head}{sep} (writing {name}){rest}")


async def retried(attempt: Callable[[], Awaitable[T]], url: str, method: str) -> T:
    """attempt() (one request to `url`), again after a transient error, 0.5, 1, 2, ... s apart,
    until the store has failed for store_timeout_s: then StoreUnreachable. A failed request on an
    upload session is UploadLost (the session is gone: only a new upload can go on); any other
    error is raised as it is (a missing object, a refused permission)."""
    target = Target.of(url)
    tries = 0
    while True:
        started = time.monotonic()
        since = _FAILING_SINCE.get(target.bucket)
        left = SETTINGS.timeout_s - (started - since) if since is not None else 0.0
        try:
            if left > 0:  # the store is failing: this attempt may take what is left of the bound
                out = await asyncio.wait_for(attempt(), left)
            else:  # it answers (or was given up on: one attempt of its own, as a new start)
                out = await attempt()
        except Exception as e:
            transient = _transient(e)
            if target.session and not transient:
                raise _lost(target, e) from e
            if isinstance(e, FileNotFoundError) and "://" in str(e):  # gcsfs: the URL alone
                raise FileNotFoundError(f"{target}: not found (the store answered 404)") from e
            if not transient:
                raise
            if target.bucket not in _FAILING_SINCE:
                log.warning(
                    "%s: the object store failed a request (%s); retrying for up to %g s "
                    "(store_timeout_s)",
                    target,
                    _why(e),
                    SETTINGS.timeout_s,
                )
            since = _FAILING_SINCE.setdefault(target.bucket, started)
            failing = time.monotonic() - since
            if failing >= SETTINGS.timeout_s:
                raise _unreachable(target, method, e) from e
            await asyncio.sleep(min(0.5 * 2**tries, 8.0, SETTINGS.timeout_s - failing))
            tries += 1
        else:
            if _FAILING_SINCE.pop(target.bucket, None) is not None:
                log.warning("%s: the object store answers again", target)
            return out
