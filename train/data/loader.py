"""The rank-strided token loader: exact, resumable, never the bottleneck.

Each epoch is a seeded permutation of every window of the split's shards; rank r of W takes the
global positions p + r, p + r + W, ... . The state (epoch, global position, fingerprints) is what
the consumer has received, so a resume is exact, and on another W continues the same stream.
gs:// shards stream through one cache folder per host (shard_cache.py). The contract:
ARCHITECTURE.md, "Loader contract"; the rest: docs/training.md, "The data loader".
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from codex.pipeline.tokenizer.bpe import SPECIAL_IDS
from codex.train.data.token_shards import ShardReader, Split, gather, load_split

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
        ids = shard_order[b : b + shuffle_shards]
        w = np.concatenate(
            [np.arange(split.window_start[i], split.window_start[i + 1]) for i in ids]
        )
        parts.append(w[rng.permutation(len(w))])
        blocks.append((pos, pos + len(w), ids))
        pos += len(w)
    return np.concatenate(parts), blocks


class TrainLoader:
    """Iterate forever over (x, y) int64 [B, T] batches of this rank; epochs roll over.

        loader = TrainLoader(run + "/shards", seq_len=1024, batch_size=16, rank=r, world_size=W,
                             seed=1337)
        loader.load_state_dict(ckpt["loader"])      # optional: resume exactly
        for step, (x, y) in zip(range(steps), loader): ...
        ckpt["loader"] = loader.state_dict()        # what this consumer has received so far

    `prefetch` batches are prepared ahead by a background thread (0: synchronous). On CUDA the
    batches are built in pinned memory and copied with non_blocking=True.
    """

    def __init__(
        self,
        shards_dir: str,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        device=None,
        prefetch: int = 2,
        cache_dir: str | None = None,
        shuffle_shards: int = 0,
        split: str = "train",
        bos_aligned: bool = False,
    ):
        """12 parameters: keyword options with defaults, as torch's DataLoader takes them; three are
        required."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.split = load_split(shards_dir, split, seq_len)
        self.seq_len, self.batch_size, self.rank, self.world_size = (
            seq_len,
            batch_size,
            rank,
            world_size,
        )
        self.seed, self.shuffle_shards, self.prefetch = (
            int(seed),
            int(shuffle_shards),
            int(prefetch),
        )
        self.device = torch.device(device) if device is not None else None
        self.pin = self.device is not None and self.device.type == "cuda"
        cache_shards = (
            2 * self.shuffle_shards if 0 < self.shuffle_shards < len(self.split.paths) else 0
        )
        self.bos_aligned = bool(bos_aligned)
        self.reader = ShardReader(
            self.split, cache_dir, cache_shards, bos=SPECIAL_IDS["bos"] if bos_aligned else None
        )
        self._orders: dict[int, tuple[np.ndarray, list]] = {}
        self._plans: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        # (epoch, position) of the next batch the consumer will receive
        self._state: tuple = (0, 0)
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
        return {"epoch": epoch, "position": position, **self.order_settings()}

    def order_settings(self) -> dict:
        """What the order depends on besides the position (a resume checks them)."""
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "windows": self.split.windows,
            "shuffle_shards": self.shuffle_shards,
            "bos_aligned": self.bos_aligned,
        }

    def load_state_dict(self, d: dict) -> None:
        if "mixture" in d:
            raise ValueError(
                "loader state was saved by a run with train.data.mixture: resume with the same "
                "mixture (train/data/mixture.py)"
            )
        for key in ("epoch", "position"):
            if key not in d:
                raise ValueError(f"loader state has no '{key}' (got keys {sorted(d)})")
        self.check_saved(d)
        if not 0 <= int(d["position"]) < self.split.windows or int(d["epoch"]) < 0:
            raise ValueError(
                f"loader state epoch={d['epoch']} position={d['position']} is out of range "
                f"(windows per epoch: {self.split.windows})"
            )
        self.close()
        self._state = (int(d["epoch"]), int(d["position"]))

    def check_saved(self, d: dict) -> None:
        """The saved state's order settings are this loader's, else a ValueError naming one."""
        mine = self.order_settings()
        for key in ("seed", "seq_len", "windows", "shuffle_shards", "bos_aligned"):
            if key in d and int(d[key]) != mine[key]:
                raise ValueError(
                    f"loader state was saved with {key}={d[key]}, this run has {key}={mine[key]}: "
                    "the data order would differ, so resuming exactly is impossible"
                )

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
        stream = (
            epoch * n
            + position
            + self.rank
            + self.world_size * np.arange(self.batch_size, dtype=np.int64)
        )
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
        nxt_epoch, nxt_pos = divmod(
            epoch * self.split.windows + position + B * self.world_size, self.split.windows
        )
        return x, y, (nxt_epoch, nxt_pos)

    def _batch(self, state):
        """(x, y, state after) of the batch at `state` (MixtureLoader draws its own)."""
        return self._make(*state)

    def _worker(self, q: queue.Queue, stop: threading.Event, state) -> None:
        try:
            while not stop.is_set():
                item = self._batch(state)
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
            x, y, state = self._batch(self._state)
        else:
            if self._thread is None:
                self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
                self._thread = threading.Thread(
                    target=self._worker,
                    args=(self._queue, self._stop, self._state),
                    name="codex-loader",
                    daemon=True,
                )
                self._thread.start()
            item = self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            x, y, state = item
        self._state = state  # only now has the consumer received this batch
        if self.device is not None and self.device.type != "cpu":
            x, y = (
                x.to(self.device, non_blocking=self.pin),
                y.to(self.device, non_blocking=self.pin),
            )
        return x, y

    def close(self) -> None:
        """Stop the prefetch thread (it restarts from the consumer's state on the next batch)."""
        if self._thread is not None:
            assert self._stop is not None  # set together with _thread
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


def val_window_ids(n: int, batch_size: int, rank: int = 0, world_size: int = 1) -> list[np.ndarray]:
    """This rank's validation batches as window ids, the same number on every rank.

    There are ceil(n / (B*W)) steps whatever the rank; step g covers windows [g*B*W, (g+1)*B*W)
    and rank r takes g*B*W + r + k*W (k < B), like training. An id >= n is past the end: it is -1
    here, a filler row that must count nothing. So a rank that has run out of windows still has a
    batch at every step (all filler), and the ids >= 0 over all ranks are 0 .. n-1, each once."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    per_step = batch_size * world_size
    k = world_size * np.arange(batch_size, dtype=np.int64)
    steps = (n + per_step - 1) // per_step
    return [np.where(ids < n, ids, -1) for ids in (g * per_step + rank + k for g in range(steps))]


def val_batches(
    shards_dir: str,
    seq_len: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    max_tokens: int = 0,
    with_mask: bool = False,
    cache_dir: str | None = None,
    split: str = "val",
):
    """The val split in a fixed order (window 0, 1, 2, ...), every window exactly once across ranks.

    Step g covers windows [g*B*W, (g+1)*B*W); rank r takes g*B*W + r + k*W (k < B), like training
    (val_window_ids). `max_tokens` > 0 keeps only the first max_tokens // seq_len windows (at
    least one).

    Several ranks (world_size > 1), or with_mask=True: every rank yields the same number of full
    (x, y, mask) batches; mask is a bool [B] that is False for filler rows (copies of window 0,
    real tokens) whose losses must be ignored. Equal counts always, not only where a layout needs
    them: a sharded model (fsdp, HSDP) all-gathers its weights in every forward, so a rank that
    skipped a batch would sit in the final loss all-reduce while the others wait for it in an
    all-gather, until the collective timeout. XLA (with_mask=True) needs full batches of one shape
    even in one process, since it compiles one graph per shape.
    One process without with_mask: yields (x, y); the last batch may be smaller.

    9 parameters: keyword options with defaults, as torch's DataLoader takes them; three are
    required."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    sp = load_split(shards_dir, split, seq_len)
    n = sp.windows if max_tokens <= 0 else min(sp.windows, max(1, max_tokens // seq_len))
    masked = with_mask or world_size > 1
    reader = ShardReader(sp, cache_dir)
    try:
        for ids in val_window_ids(n, batch_size, rank, world_size):
            valid = ids >= 0
            ids = np.where(valid, ids, 0) if masked else ids[valid]
            x = np.empty((len(ids), seq_len), dtype=np.int64)
            y = np.empty((len(ids), seq_len), dtype=np.int64)
            gather(reader, ids, x, y)
            if masked:
                yield torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(valid)
            else:
                yield torch.from_numpy(x), torch.from_numpy(y)
    finally:
        reader.close()
