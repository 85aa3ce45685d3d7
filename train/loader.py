"""The rank-strided token loader: exact, resumable, never the bottleneck.

Contract (ARCHITECTURE.md, "Loader contract"):

- A split is its npy shards in manifest order. A shard of n tokens gives (n - 1) // T windows;
  window j is shard[j*T : j*T + T + 1] (x = first T, y = last T). Windows are numbered globally.
- Training order: per epoch, a seeded permutation of all window ids (numpy default_rng([seed,
  epoch])). The epochs are laid end to end as one infinite stream; stream position
  s = epoch * windows_per_epoch + position.
- Rank r of W, with a global position p, takes stream positions p + r, p + r + W, ... (B of them);
  one step covers [p, p + B*W) for all ranks together. A batch that runs past the end of an epoch
  simply continues into the next epoch's permutation: every batch is full, nothing is padded or
  dropped, and every window is seen exactly once per epoch.
- State: {"epoch", "position"} (global, identical on every rank) plus a few fingerprint keys that
  make a resume on different data or a different seq_len an error rather than a silent change.
  Resuming with another W (or B) continues the same global stream.

The state always describes what the consumer has received, never what the background thread has
read ahead: each prefetched batch carries the state after it, and the loader adopts that state
when it hands the batch out.

Speed: one batch is a handful of numpy fancy-index gathers (one per shard touched) from a strided
(windows, T+1) view of each memory-mapped shard straight into int64 buffers (pinned on CUDA); no
Python loop over windows. bench/bench_loader.py measures it.

gs:// shards are streamed into the host's local cache (train/shard_cache.py: one folder for all
local ranks, one download per shard per host, flock so that no process deletes a file another
one holds). Each rank fetches only the shards its own windows touch, in the blocks of its current
batch and the block after (double buffering), and lets go of a shard after its last window. With
the default full shuffle a block is the whole epoch, so the cache holds all shards;
`shuffle_shards=K` makes the permutation block-structured instead (the shard order is shuffled
per epoch, then windows are shuffled within each group of K shards), so about 2*K shards per host
are on local disk at a time (3*K while ranks straddle a block boundary). K is part of the state:
changing it changes the order, so a resume with another K is refused.
"""

from __future__ import annotations

import hashlib
import os
import queue
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from codex import fsio
from train.shard_cache import HostShardCache

DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}


# ----------------------------------------------------------------------------- manifest / splits

def load_manifest(shards_dir: str) -> dict:
    """Read and validate RUN/shards/manifest.json; errors name the file and the bad key."""
    path = fsio.join(shards_dir, "manifest.json")
    if not fsio.exists(path):
        raise FileNotFoundError(f"{path}: no shard manifest (run `codex data shard`; the manifest is written "
                                "last, so an interrupted shard stage leaves none)")
    m = fsio.read_json(path)
    if not isinstance(m, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if m.get("format_version") != 1:
        raise ValueError(f"{path}: format_version {m.get('format_version')!r} is not supported (expected 1)")
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
            raise ValueError(f"{path}: shards[{i}] format {s.get('format')!r} is not supported (expected npy or parquet)")
        if not isinstance(s["tokens"], int) or s["tokens"] < 0:
            raise ValueError(f"{path}: shards[{i}].tokens must be a non-negative integer, got {s['tokens']!r}")
        fsio.join_inside(shards_dir, s["path"], f"{path}: shards[{i}].path")
    return m


@dataclass
class Split:
    """The windows of one split: shard i holds global windows [window_start[i], window_start[i+1])."""
    name: str
    shards_dir: str
    paths: list[str]           # full paths (local or gs://)
    tokens: np.ndarray         # int64 [n_shards], tokens per shard (from the manifest)
    sha256: list[str | None]
    dtype: np.dtype
    seq_len: int
    window_start: np.ndarray   # int64 [n_shards + 1]

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
        raise ValueError(f"{fsio.join(shards_dir, 'manifest.json')}: the {split} split has only parquet shards; "
                         "training reads .npy: re-run `codex data shard --format both` (or npy)")
    tokens = np.array([s["tokens"] for s in entries], dtype=np.int64)
    per_shard = np.maximum(tokens - 1, 0) // seq_len
    split_obj = Split(split, shards_dir, [fsio.join(shards_dir, s["path"]) for s in entries], tokens,
                      [s.get("sha256") for s in entries], np.dtype(DTYPES[m["dtype"]]), seq_len,
                      np.concatenate([[0], np.cumsum(per_shard)]).astype(np.int64))
    if split_obj.windows == 0:
        raise ValueError(f"{fsio.join(shards_dir, 'manifest.json')}: the {split} split has no window of "
                         f"seq_len+1 = {seq_len + 1} tokens ({len(entries)} shards, {int(tokens.sum())} tokens)")
    return split_obj


# ----------------------------------------------------------------------------- shard access

class ShardReader:
    """Shard i as a 1-D numpy array: a memory map of the local file, or of the host's cached copy
    of a gs:// shard (train/shard_cache.py). For gs://, `prefetch(ids)` says which shards this
    process needs next: it holds those (downloading the missing ones on a small thread pool, in
    the given order) and lets go of the others, which the host cache may then evict once no other
    process holds them either (at most about `cache_shards` files of the split per host)."""

    def __init__(self, split: Split, cache_dir: str | None = None, cache_shards: int = 0, download_workers: int = 2):
        self.split = split
        self.remote = fsio.is_remote(split.shards_dir)
        self.maps: dict[int, np.ndarray] = {}
        self.lock = threading.Lock()
        if self.remote:
            key = hashlib.sha1(split.shards_dir.rstrip("/").encode()).hexdigest()[:12]
            self.cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), "codex-shard-cache", key)
            os.makedirs(self.cache_dir, exist_ok=True)
            self.cache = HostShardCache(self.cache_dir, split.name, split.paths, split.sha256,
                                        cache_shards if cache_shards > 0 else len(split.paths))
            self.pool = ThreadPoolExecutor(max_workers=download_workers, thread_name_prefix="codex-shard-dl")
            self.pending: dict[int, Future] = {}

    @property
    def fetched(self) -> list[int]:
        """The shards this process downloaded (gs://), in order."""
        return list(self.cache.fetched) if self.remote else []

    def _open(self, i: int, path: str) -> np.ndarray:
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.split.paths[i]}: cannot memory-map shard ({e})") from e
        if arr.ndim != 1 or arr.dtype != self.split.dtype or arr.shape[0] != self.split.tokens[i]:
            raise ValueError(f"{self.split.paths[i]}: shard is {arr.dtype}{list(arr.shape)}, the manifest says "
                             f"{self.split.dtype}[{int(self.split.tokens[i])}]")
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
            for i in [i for i, f in self.pending.items() if f.done() or (i not in keep and f.cancel())]:
                del self.pending[i]  # a failed prefetch is retried (and raises) when the shard is used
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

    def close(self) -> None:
        if self.remote:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.cache.close()
            self.maps.clear()


def gather(reader: ShardReader, window_ids: np.ndarray, out_x: np.ndarray, out_y: np.ndarray) -> None:
    """Fill out_x / out_y (int64 [k, T]) with the windows `window_ids`, in order.

    One numpy gather per shard touched: rows of a strided (windows, T+1) view of the memory map."""
    split, T = reader.split, reader.split.seq_len
    shard = np.searchsorted(split.window_start, window_ids, side="right") - 1
    local = window_ids - split.window_start[shard]
    for s in np.unique(shard):
        rows = np.nonzero(shard == s)[0]
        arr = reader.array(int(s))
        n_win = int(split.window_start[s + 1] - split.window_start[s])
        view = np.lib.stride_tricks.as_strided(arr, shape=(n_win, T + 1),
                                               strides=(T * arr.itemsize, arr.itemsize), writeable=False)
        win = view[local[rows]]  # [k, T+1] copy out of the page cache
        if len(rows) == len(window_ids):
            out_x[:] = win[:, :T]
            out_y[:] = win[:, 1:]
        else:
            out_x[rows] = win[:, :T]
            out_y[rows] = win[:, 1:]


# ----------------------------------------------------------------------------- training order

def epoch_order(split: Split, seed: int, epoch: int, shuffle_shards: int = 0):
    """(permutation of all window ids for this epoch, blocks), blocks = [(start, end, shard_ids)]:
    stream positions [start, end) of the epoch only use windows of those shards."""
    rng = np.random.default_rng([int(seed), int(epoch)])
    n_shards, n = len(split.paths), split.windows
    if shuffle_shards <= 0 or shuffle_shards >= n_shards:
        return rng.permutation(n), [(0, n, np.arange(n_shards))]
    shard_order = rng.permutation(n_shards)
    parts, blocks, pos = [], [], 0
    for b in range(0, n_shards, shuffle_shards):
        ids = shard_order[b:b + shuffle_shards]
        w = np.concatenate([np.arange(split.window_start[i], split.window_start[i + 1]) for i in ids])
        parts.append(w[rng.permutation(len(w))])
        blocks.append((pos, pos + len(w), ids))
        pos += len(w)
    return np.concatenate(parts), blocks


class TrainLoader:
    """Iterate forever over (x, y) int64 [B, T] batches of this rank; epochs roll over.

        loader = TrainLoader(run + "/shards", seq_len=1024, batch_size=16, rank=r, world_size=W, seed=1337)
        loader.load_state_dict(ckpt["loader"])      # optional: resume exactly
        for step, (x, y) in zip(range(steps), loader): ...
        ckpt["loader"] = loader.state_dict()        # what this consumer has received so far

    `prefetch` batches are prepared ahead by a background thread (0: synchronous). On CUDA the
    batches are built in pinned memory and copied with non_blocking=True.
    """

    def __init__(self, shards_dir: str, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, device=None, prefetch: int = 2, cache_dir: str | None = None,
                 shuffle_shards: int = 0, split: str = "train"):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.split = load_split(shards_dir, split, seq_len)
        self.seq_len, self.batch_size, self.rank, self.world_size = seq_len, batch_size, rank, world_size
        self.seed, self.shuffle_shards, self.prefetch = int(seed), int(shuffle_shards), int(prefetch)
        self.device = torch.device(device) if device is not None else None
        self.pin = self.device is not None and self.device.type == "cuda"
        cache_shards = 2 * self.shuffle_shards if 0 < self.shuffle_shards < len(self.split.paths) else 0
        self.reader = ShardReader(self.split, cache_dir, cache_shards)
        self._orders: dict[int, tuple[np.ndarray, list]] = {}
        self._plans: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._state = (0, 0)  # (epoch, position) of the next batch the consumer will receive
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None

    @property
    def windows_per_epoch(self) -> int:
        return self.split.windows

    @property
    def tokens_per_epoch(self) -> int:
        return self.split.windows * self.seq_len

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        epoch, position = self._state
        return {"epoch": epoch, "position": position, "seed": self.seed, "seq_len": self.seq_len,
                "windows": self.split.windows, "shuffle_shards": self.shuffle_shards}

    def load_state_dict(self, d: dict) -> None:
        for key in ("epoch", "position"):
            if key not in d:
                raise ValueError(f"loader state has no '{key}' (got keys {sorted(d)})")
        mine = self.state_dict()
        for key in ("seed", "seq_len", "windows", "shuffle_shards"):
            if key in d and int(d[key]) != mine[key]:
                raise ValueError(f"loader state was saved with {key}={d[key]}, this run has {key}={mine[key]}: "
                                 "the data order would differ, so resuming exactly is impossible")
        if not 0 <= int(d["position"]) < self.split.windows or int(d["epoch"]) < 0:
            raise ValueError(f"loader state epoch={d['epoch']} position={d['position']} is out of range "
                             f"(windows per epoch: {self.split.windows})")
        self.close()
        self._state = (int(d["epoch"]), int(d["position"]))

    # -- batches -------------------------------------------------------------------------------
    def _order(self, epoch: int):
        if epoch not in self._orders:
            self._orders[epoch] = epoch_order(self.split, self.seed, epoch, self.shuffle_shards)
            for old in [e for e in self._orders if e < epoch - 1]:
                del self._orders[old]
        return self._orders[epoch]

    def window_ids(self, epoch: int, position: int) -> np.ndarray:
        """The window ids of this rank's batch whose global step starts at (epoch, position)."""
        n = self.split.windows
        stream = epoch * n + position + self.rank + self.world_size * np.arange(self.batch_size, dtype=np.int64)
        ep, pos = np.divmod(stream, n)
        ids = np.empty(self.batch_size, dtype=np.int64)
        for e in np.unique(ep):  # one or two epochs, unless B*W > windows per epoch
            sel = ep == e
            ids[sel] = self._order(int(e))[0][pos[sel]]
        return ids

    def _block_plan(self, epoch: int, k: int, phase: int):
        """This rank's use of block k of `epoch`: (shard ids in order of first use, the epoch
        position of each one's last use). The rank takes the stream positions s = phase (mod W)."""
        key = (epoch, k, phase)
        if key not in self._plans:
            order, blocks = self._order(epoch)
            a, b, _ = blocks[k]
            n, W = self.split.windows, self.world_size
            pos = np.arange(a + (phase - epoch * n - a) % W, b, W)
            shard = np.searchsorted(self.split.window_start, order[pos], side="right") - 1
            ids, first = np.unique(shard, return_index=True)
            _, last_rev = np.unique(shard[::-1], return_index=True)
            by_first = np.argsort(first)
            self._plans[key] = (ids[by_first], pos[len(pos) - 1 - last_rev][by_first])
            for old in [o for o in self._plans if o[0] < epoch - 1]:
                del self._plans[old]
        return self._plans[key]

    def _needed_shards(self, epoch: int, position: int) -> list[int]:
        """The shards this rank's own windows touch from (epoch, position) on, in the blocks this
        batch spans and the block after the one it starts in (double buffering): about 2K with
        shuffle_shards=K, nothing another rank alone reads."""
        n, W = self.split.windows, self.world_size
        start = epoch * n + position
        end = start + self.batch_size * W  # this step's stream positions: [start, end)
        phase = (start + self.rank) % W
        blocks = self._order(epoch)[1]
        e, k = epoch, next(i for i, (a, b, _) in enumerate(blocks) if a <= position < b)
        want, count = [], 0
        while True:
            ids, last = self._block_plan(e, k, phase)
            want += ids[e * n + last >= start].tolist()  # a shard this rank is done with is let go
            count += 1
            if count >= 2 and e * n + blocks[k][1] >= end:
                break
            k += 1
            if k == len(blocks):
                e, k = e + 1, 0
                blocks = self._order(e)[1]
        return list(dict.fromkeys(want))

    def _prefetch_shards(self, epoch: int, position: int) -> None:
        if self.reader.remote:
            self.reader.prefetch(self._needed_shards(epoch, position))

    def _make(self, epoch: int, position: int):
        """Build the batch starting at (epoch, position); return (x, y, state after it)."""
        self._prefetch_shards(epoch, position)
        ids = self.window_ids(epoch, position)
        B, T = self.batch_size, self.seq_len
        x = torch.empty((B, T), dtype=torch.int64, pin_memory=self.pin)
        y = torch.empty((B, T), dtype=torch.int64, pin_memory=self.pin)
        gather(self.reader, ids, x.numpy(), y.numpy())
        nxt_epoch, nxt_pos = divmod(epoch * self.split.windows + position + B * self.world_size, self.split.windows)
        return x, y, (nxt_epoch, nxt_pos)

    def _worker(self, q: queue.Queue, stop: threading.Event, state) -> None:
        try:
            while not stop.is_set():
                item = self._make(*state)
                state = item[2]
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # hand the error to the consumer; never die silently
            while not stop.is_set():
                try:
                    q.put(e, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def __iter__(self):
        return self

    def __next__(self):
        if self.prefetch <= 0:
            x, y, state = self._make(*self._state)
        else:
            if self._thread is None:
                self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
                self._thread = threading.Thread(target=self._worker, args=(self._queue, self._stop, self._state),
                                                name="codex-loader", daemon=True)
                self._thread.start()
            item = self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            x, y, state = item
        self._state = state  # only now has the consumer received this batch
        if self.device is not None and self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=self.pin), y.to(self.device, non_blocking=self.pin)
        return x, y

    def close(self) -> None:
        """Stop the prefetch thread (it restarts from the consumer's state on the next batch)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = self._queue = self._stop = None

    def __del__(self):
        try:
            self.close()
            self.reader.close()
        except Exception:
            pass


# ----------------------------------------------------------------------------- validation

def val_batches(shards_dir: str, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1,
                max_tokens: int = 0, with_mask: bool = False, cache_dir: str | None = None, split: str = "val"):
    """The val split in a fixed order (window 0, 1, 2, ...), every window exactly once across ranks.

    Step g covers windows [g*B*W, (g+1)*B*W); rank r takes g*B*W + r + k*W (k < B), like training.
    `max_tokens` > 0 keeps only the first max_tokens // seq_len windows (at least one).

    with_mask=False: yields (x, y); the last batch of a rank may be smaller (rows past the end are
    dropped), and a rank with nothing left yields nothing, so ranks may yield different counts.
    with_mask=True (XLA, or any collective per batch): every rank yields the same number of full
    (x, y, mask) batches; mask is a bool [B] that is False for filler rows (copies of window 0,
    real tokens) whose losses must be ignored.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    sp = load_split(shards_dir, split, seq_len)
    n = sp.windows if max_tokens <= 0 else min(sp.windows, max(1, max_tokens // seq_len))
    reader = ShardReader(sp, cache_dir)
    per_step = batch_size * world_size
    try:
        for g in range((n + per_step - 1) // per_step):
            ids = g * per_step + rank + world_size * np.arange(batch_size, dtype=np.int64)
            valid = ids < n
            if with_mask:
                ids = np.where(valid, ids, 0)
            else:
                ids = ids[valid]
                if len(ids) == 0:
                    continue
            x = np.empty((len(ids), seq_len), dtype=np.int64)
            y = np.empty((len(ids), seq_len), dtype=np.int64)
            gather(reader, ids, x, y)
            if with_mask:
                yield torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(valid)
            else:
                yield torch.from_numpy(x), torch.from_numpy(y)
    finally:
        reader.close()
