"""gcsfs as codex uses it: each request is retried by codex.core.store.retried (bounded by
store_timeout_s, a lost upload session named) instead of gcsfs's own six tries, and a connect, a
read or a request's body that hangs ends after store_timeout_s; a folder's names are listed a page
at a time, names only (names_under). fsio.filesystem makes every gs:// client with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import gcsfs

from codex.core import store

# One try of a request: gcsfs's _request without its retry decorator (`decorator` keeps the
# undecorated function as __wrapped__); where a gcsfs lacks it, its retries run inside ours.
_ONE_TRY = getattr(gcsfs.GCSFileSystem._request, "__wrapped__", None)


class BoundedGCSFileSystem(gcsfs.GCSFileSystem):
    """gcsfs.GCSFileSystem whose requests go through store.retried."""

    async def _request(self, method, path, *args, **kwargs):
        url = self._format_path(path, args)
        if _ONE_TRY is None:
            one = lambda: super(BoundedGCSFileSystem, self)._request(method, path, *args, **kwargs)  # noqa: E731
        else:
            one = lambda: _ONE_TRY(self, method, path, *args, **kwargs)  # noqa: E731
        if kwargs.get("data"):
            # aiohttp bounds no write: a store that takes the headers and stops reading the body
            # would hold the upload for ever. One body (a whole small object, or one chunk of a
            # resumable upload, gcsfs' 50 MB at most) must go through within the bound.
            return await store.retried(
                lambda: asyncio.wait_for(one(), store.SETTINGS.timeout_s), url, method
            )
        return await store.retried(one, url, method)

    @property
    def requests_timeout(self) -> aiohttp.ClientTimeout:
        """Each request's connect and each read wait store_timeout_s at most (aiohttp's default
        would wait 5 min); a slow transfer that keeps moving is not cut."""
        bound = store.SETTINGS.timeout_s
        return aiohttp.ClientTimeout(sock_connect=bound, sock_read=bound)

    @requests_timeout.setter
    def requests_timeout(self, value) -> None:
        """gcsfs's __init__ sets it; the bound is store_timeout_s, read on each request."""

    async def _info(self, path, generation=None, **kwargs):
        """An object's metadata in one request: gcsfs asks for the object and lists its name as
        a folder at once, two requests for every open for reading. A folder, or a path that is
        not an object, goes on to gcsfs' own."""
        if generation is None and "/" in self._strip_protocol(path).rstrip("/"):
            try:
                return await self._get_object(path)
            except FileNotFoundError:
                pass
        return await super()._info(path, generation=generation, **kwargs)

    def names_under(self, path: str) -> Iterator[str]:
        """The names (not paths) of the objects and prefixes directly under folder `path`, a page
        of up to 1,000 a request, asked for without their metadata (`fields`): a folder of a
        million objects is a thousand requests and never a million ~3 KB entries in memory, as
        gcsfs' ls would hold."""
        bucket, key, _ = self.split_path(path)
        prefix = key.rstrip("/") + "/" if key else ""
        token = None
        while True:
            page = self.call(
                "GET",
                "b/{}/o",
                bucket,
                prefix=prefix,
                delimiter="/",
                fields="items(name),prefixes,nextPageToken",
                maxResults=1000,
                pageToken=token,
                json_out=True,
            )
            for item in page.get("items", ()):
                name = item["name"][len(prefix) :]
                if name:  # the folder's own placeholder object, where one was made
                    yield name
            for sub in page.get("prefixes", ()):
                yield sub[len(prefix) :].rstrip("/")
            token = page.get("nextPageToken")
            if not token:
                return
