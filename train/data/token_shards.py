"""Reading token shards: RUN/shards/manifest.json, a split's windows, and one rank's view of the
shard files (memory-mapped locally, or through the host's gs:// cache), gathered into batches.

    split = load_split(shards_dir, "train", seq_len)  # paths + window offsets, from the manifest
    reader = ShardReader(split, cache_dir=...)       # memmaps; gs:// via train/data/shard_cache.py
    gather(reader, window_ids, out_x, out_y)          # one numpy gather per shard touched

The window rule and the training order are in train/data/loader.py's docstring (the loader
contract).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from codex.core import fsio
from codex.train.data.shard_cache import HostShardCache

DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}


# ----------------------------------------------------------------------------- manifest / splits


def load_manifest(shards_dir: str) -> dict:
    """Read and validate RUN/shards/manifest.json; errors name the file and the bad key."""
    path = fsio.join(shards_dir, "manifest.json")
    if not fsio.exists(path):
        raise FileNotFoundError(
            f"{path}: no shard manifest (run `codex data shard`; the manifest is written "
            "last, so an interrupted shard stage leaves none)"
        )
    m = fsio.read_json(path)
    if not isinstance(m, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if m.get("format_version") != 1:
        raise ValueError(
            f"{path}: format_version {m.get('format_version')!r} is not supported (expected 1)"
        )
    if m.get("dtype") not in DTYPES:
        raise ValueError(f"{path}: dtype {m.get('dtype')!r} is not one of {sorted(DTYPES)}")
    shards = m.get("shards")
    if not isinstance(shards, list):
        raise ValueError(f"{path}: 'shards' must be a list")
    for i, s in enumerate(shards):
        for key in ("split", "path", "tokens"):
            if key not in s:
                raise ValueError(f"{path}: shards[{i}] has no '{key}'")
        if s.get("format", "npy") not in ("npy", "parquet"):
            raise ValueError(
                f"{path}: shards[{i}] format {s.get('format')!r} is not supported "
                "(expected npy or parquet)"
            )
        if not isinstance(s["tokens"], int) or s["tokens"] < 0:
            raise ValueError(
                f"{path}: shards[{i}].tokens must be a non-negative integer, got {s['tokens']!r}"
            )
        fsio.join_inside(shards_dir, s["path"], f"{path}: shards[{i}].path")
    return m


@dataclass
class Split:
    """The windows of one split: shard i holds global windows [window_start[i],
    window_start[i+1])."""

    name: str
    shards_dir: str
    paths: list[str]  # full paths (local or gs://)
    tokens: np.ndarray  # int64 [n_shards], tokens per shard (from the manifest)
    sha256: list[str | None]
    dtype: np.dtype
    seq_len: int
    window_start: np.ndarray  # int64 [n_shards + 1]

    @property
    def windows(self) -> int:
        return int(self.window_start[-1])


def load_split(shards_dir: str, split: str, seq_len: int, manifest: dict | None = None) -> Split:
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    m = manifest if manifest is not None else load_manifest(shards_dir)
    # The loader memory-maps the .npy shards; parquet copies (--format both) are for other readers.
    entries = [s for s in m["shards"] if s["split"] == split and s.get("format", "npy") == "npy"]
    if not entries and any(s["split"] == split for s in m["shards"]):
        raise ValueError(
            f"{fsio.join(shards_dir, 'manifest.json')}: the {split} split has only parquet shards; "
            "training reads .npy: re-run `codex data shard --format both` (or npy)"
        )
    tokens = np.array([s["tokens"] for s in entries], dtype=np.int64)
    per_shard = np.maximum(tokens - 1, 0) // seq_len
    split_obj = Split(
        split,
        shards_dir,
        [fsio.join(shards_dir, s["path"]) for s in entries],
        tokens,
        [s.get("sha256") for s in entries],
        np.dtype(DTYPES[m["dtype"]]),
        seq_len,
        np.concatenate([[0], np.cumsum(per_shard)]).astype(np.int64),
    )
    if split_obj.windows == 0:
        raise ValueError(
            f"{fsio.join(shards_dir, 'manifest.json')}: the {split} split has no window of "
            f"seq_len+1 = {seq_len + 1} tokens ({len(entries)} shards, {int(tokens.sum())} tokens)"
        )
    return split_obj


# ----------------------------------------------------------------------------- shard access


class ShardReader:
    """Shard i as a 1-D numpy array: a memory map of the local file, or of the host's cached copy
    of a gs:// shard (train/data/shard_cache.py). For gs://, `prefetch(ids)` says which shards this
    process needs next: it holds those (downloading the missing ones on a small thread pool, in
    the given order) and lets go of the others, which the host cache may then evict once no other
    process holds them either (at most about `cache_shards` files of the split per host)."""

    def __init__(
        self,
        split: Split,
        cache_dir: str | None = None,
        cache_shards: int = 0,
        download_workers: int = 2,
        bos: int | None = None,
    ):
        self.split = split
        self.remote = fsio.is_remote(split.shards_dir)
        self.maps: dict[int, np.ndarray] = {}
        self.bos = bos  # not None: windows start at a document's <|bos|> (window_starts)
        self.starts: dict[int, np.ndarray] = {}
        self.lock = threading.Lock()
        if self.remote:
            key = hashlib.sha1(split.shards_dir.rstrip("/").encode()).hexdigest()[:12]
            self.cache_dir = cache_dir or os.path.join(
                tempfile.gettempdir(), "codex-shard-cache", key
            )
            os.makedirs(self.cache_dir, exist_ok=True)
            self.cache = HostShardCache(
                self.cache_dir,
                split.name,
                split.paths,
                split.sha256,
                cache_shards if cache_shards > 0 else len(split.paths),
            )
            self.pool = ThreadPoolExecutor(
                max_workers=download_workers, thread_name_prefix="codex-shard-dl"
            )
            self.pending: dict[int, Future] = {}

    @property
    def fetched(self) -> list[int]:
        """The shards this process downloaded (gs://), in order."""
        return list(self.cache.fetched) if self.remote else []

    def _open(self, i: int, path: str) -> np.ndarray:
        expected = self.split.sha256[i]
        # A local shard is checked against the manifest the first time this process opens it (one
        # sequential read); a gs:// one was checked when the host cache downloaded it.
        if not self.remote and expected and fsio.file_sha256(path) != expected:
            raise ValueError(
                f"{path}: shard does not match its sha256 in the manifest (damaged or replaced); "
                "`codex data verify` lists every bad shard, `codex data shard` rewrites them"
            )
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.split.paths[i]}: cannot memory-map shard ({e})") from e
        if arr.ndim != 1 or arr.dtype != self.split.dtype or arr.shape[0] != self.split.tokens[i]:
            raise ValueError(
                f"{self.split.paths[i]}: shard is {arr.dtype}{list(arr.shape)}, the manifest says "
                f"{self.split.dtype}[{int(self.split.tokens[i])}]"
            )
        return arr

    def _fetch(self, i: int) -> str:
        path = self.cache.acquire(i)
        self.cache.evict()
        return path

    def prefetch(self, shard_ids) -> None:
        """Hold exactly these shards from now on: start fetching the missing ones (in this order),
        release the rest."""
        if not self.remote:
            return
        want = [int(i) for i in shard_ids]
        keep = set(want)
        released = False
        with self.lock:
            for i in [
                i for i, f in self.pending.items() if f.done() or (i not in keep and f.cancel())
            ]:
                # a failed prefetch is retried (and raises) when the shard is used
                del self.pending[i]
            for i in [i for i in self.cache.held_ids() if i not in keep and i not in self.pending]:
                self.maps.pop(i, None)
                self.cache.release(i)
                released = True
            for i in want:
                if i not in self.pending and not self.cache.holds(i):
                    self.pending[i] = self.pool.submit(self._fetch, i)
        if released:
            self.cache.evict()

    def array(self, i: int) -> np.ndarray:
        with self.lock:
            arr = self.maps.get(i)
            if arr is not None:
                return arr
            if not self.remote:
                arr = self.maps[i] = self._open(i, self.split.paths[i])
                return arr
            fut = self.pending.get(i)
        # Outside the lock: other shards keep downloading meanwhile. A fetch still queued behind
        # others is cancelled and done right here instead.
        path = self._fetch(i) if fut is None or fut.cancel() else fut.result()
        with self.lock:
            if self.pending.get(i) is fut:
                self.pending.pop(i, None)
            arr = self.maps[i] = self._open(i, path)
        return arr

    def window_starts(self, i: int) -> np.ndarray | None:
        """Token offsets of shard i's windows when BOS-aligned (computed once per shard), else
        None."""
        if self.bos is None:
            return None
        if i not in self.starts:
            n_win = int(self.split.window_start[i + 1] - self.split.window_start[i])
            self.starts[i] = bos_aligned_starts(self.array(i), n_win, self.split.seq_len, self.bos)
        return self.starts[i]

    def close(self) -> None:
        if self.remote:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.cache.close()
            self.maps.clear()


def bos_aligned_starts(arr: np.ndarray, n_win: int, T: int, bos: int) -> np.ndarray:
    """Where each of a shard's n_win windows starts when BOS-aligned: window j at the first <|bos|>
    in [j*T, (j+1)*T) whose T+1 tokens still fit in the shard, else at j*T as usual. The window ids,
    their count and so the training order and its exact resume are unchanged; a window that moves
    skips the tail of the previous document and overlaps the next window (modded-nanogpt's and
    nanochat's point: a model sees more documents from their start, with their whole context)."""
    grid = np.arange(n_win, dtype=np.int64) * T
    bos_at = np.flatnonzero(np.asarray(arr) == bos)
    if len(bos_at) == 0:
        return grid
    first = bos_at[np.minimum(np.searchsorted(bos_at, grid), len(bos_at) - 1)]
    fits = (first >= grid) & (first < grid + T) & (first + T + 1 <= len(arr))
    return np.where(fits, first, grid)


def gather(
    reader: ShardReader, window_ids: np.ndarray, out_x: np.ndarray, out_y: np.ndarray
) -> None:
    """Fill out_x / out_y (int64 [k, T]) with the windows `window_ids`, in order.

    One numpy gather per shard touched: rows of a strided (windows, T+1) view of the memory map, or
    of the BOS-aligned window starts (reader.bos)."""
    split, T = reader.split, reader.split.seq_len
    shard = np.searchsorted(split.window_start, window_ids, side="right") - 1
    local = window_ids - split.window_start[shard]
    for s in np.unique(shard):
        rows = np.nonzero(shard == s)[0]
        arr = reader.array(int(s))
        starts = reader.window_starts(int(s))
        if starts is not None:
            win = arr[starts[local[rows]][:, None] + np.arange(T + 1)]
        else:
            n_win = int(split.window_start[s + 1] - split.window_start[s])
            view = np.lib.stride_tricks.as_strided(
                arr, shape=(n_win, T + 1), strides=(T * arr.itemsize, arr.itemsize), writeable=False
            )
            win = view[local[rows]]  # [k, T+1] copy out of the page cache
        if len(rows) == len(window_ids):
            out_x[:] = win[:, :T]
            out_y[:] = win[:, 1:]
        else:
            out_x[rows] = win[:, :T]
            out_y[rows] = win[:, 1:]
