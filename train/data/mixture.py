"""Weighted mixtures of sources (train.data.mixture): the rank-strided loader drawing each global
position from a source by weight, exact and resumable.

Global positions g = 0, 1, 2, ... go to sources by smooth weighted round robin over integer
weights (every prefix is within a sequence a source of its share); a source's k-th draw is window
k mod n of its own seeded permutation of epoch k // n (a source that runs out starts its next
epoch, reshuffled). Rank r of W takes g = p + r, p + r + W, ..., as TrainLoader does, so the global
batch is the same for any W. The state: g and, per source, its draws and its credit.
docs/training.md, "Mixtures", has the rest.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from codex.core import fsio
from codex.core.config import ConfigError
from codex.train.data.loader import TrainLoader, epoch_order
from codex.train.data.token_shards import Split, gather, load_manifest

log = logging.getLogger("codex.train")

# a weight is its share of this many units (integer credits: the same on every host, exact)
WEIGHT_UNITS = 1 << 20


@dataclass
class Mixture:
    """What a MixtureLoader draws: weights by source name, and weights that take over at a step
    (schedule: (step, weights), steps increasing; sequences_per_step: global positions a step)."""

    weights: dict[str, float]
    schedule: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    sequences_per_step: int = 0

    @classmethod
    def from_config(cls, d, sequences_per_step: int = 0) -> Mixture:
        """From train.data (codex/core/config/train.py: TrainDataConfig)."""
        schedule = [(int(e["step"]), dict(e["mixture"])) for e in d.mixture_schedule]
        return cls(dict(d.mixture), schedule, sequences_per_step)


def manifest_sources(manifest: dict, split: str = "train") -> list[str]:
    """The source names of a split's .npy shards, in first-appearance order ([] when the shards
    carry none: one source)."""
    names = [
        e.get("source")
        for e in manifest.get("shards", [])
        if e.get("split") == split and e.get("format", "npy") == "npy"
    ]
    return list(dict.fromkeys(n for n in names if n))


def check_sources(d, manifest: dict, shards_dir: str) -> None:
    """Every source train.data's mixtures name is one of the shards' (a ConfigError naming the
    key and the sources there are)."""
    known = manifest_sources(manifest)
    mixtures = [("train.data.mixture", d.mixture)] + [
        (f"train.data.mixture_schedule[{i}].mixture", e["mixture"])
        for i, e in enumerate(d.mixture_schedule)
    ]
    for key, weights in mixtures:
        for name in weights:
            if name not in known:
                have = ", ".join(known) if known else "none: shard with data.shard.sources"
                raise ConfigError(
                    f"{key}: no source {name!r} in {fsio.join(shards_dir, 'manifest.json')} "
                    f"(its sources: {have})",
                    (key.split("[")[0],),
                )


def integer_weights(weights: dict[str, float], names: list[str]) -> tuple[int, ...]:
    """Each source's weight in WEIGHT_UNITS (a source not named: 0; a positive one at least 1)."""
    total = sum(weights.values())
    return tuple(
        max(1, round(weights[n] / total * WEIGHT_UNITS)) if weights.get(n, 0) > 0 else 0
        for n in names
    )


def assign(credits: list[int], weights: tuple[int, ...]) -> int:
    """One position of smooth weighted round robin (nginx's): every credit grows by its weight,
    the largest (the first on a tie) is drawn and gives back the weights' sum. `credits` is
    updated; returns the source drawn."""
    total, best, most = 0, -1, 0
    for i, w in enumerate(weights):
        c = credits[i] = credits[i] + w
        total += w
        if w > 0 and (best < 0 or c > most):
            best, most = i, c
    credits[best] -= total
    return best


@dataclass
class _Source:
    """One source's windows: its shards' indices in the loader's split and its own Split."""

    name: str
    shards: np.ndarray
    split: Split
    seed: int


class MixtureLoader(TrainLoader):
    """TrainLoader's interface (iterate, state_dict, load_state_dict, close), drawing each global
    position from a source of `mixture` (module docstring).

        loader = MixtureLoader(run + "/shards", 1024, 16, Mixture({"web": 0.7, "code": 0.3}),
                               rank=r, world_size=W, seed=1337)
    """

    def __init__(self, shards_dir: str, seq_len: int, batch_size: int, mixture: Mixture, **kw):
        """`kw`: TrainLoader's keyword options (rank, world_size, seed, prefetch, ...)."""
        super().__init__(shards_dir, seq_len, batch_size, **kw)
        manifest = load_manifest(shards_dir)
        entries = [
            e
            for e in manifest["shards"]
            if e["split"] == self.split.name and e.get("format", "npy") == "npy"
        ]
        names = manifest_sources(manifest, self.split.name)
        if not names or any(not e.get("source") for e in entries):
            raise ConfigError(
                f"train.data.mixture: the shards in {shards_dir} are not split by source "
                "(shard several runs with data.shard.sources)",
                ("train.data.mixture",),
            )
        per_shard = np.diff(self.split.window_start)
        self.sources: list[_Source] = []
        for name in names:
            ids = np.array([i for i, e in enumerate(entries) if e["source"] == name], np.int64)
            sp = self.split
            starts = np.concatenate([[0], np.cumsum(per_shard[ids])]).astype(np.int64)
            split = Split(
                f"{sp.name}:{name}",
                sp.shards_dir,
                [sp.paths[i] for i in ids],
                sp.tokens[ids],
                [sp.sha256[i] for i in ids],
                sp.dtype,
                sp.seq_len,
                starts,
            )
            seed = (self.seed << 32) + zlib.crc32(name.encode())
            self.sources.append(_Source(name, ids, split, seed))
        self.mixture = mixture
        self._weights = [(0, integer_weights(mixture.weights, names))] + [
            (step, integer_weights(w, names)) for step, w in mixture.schedule
        ]
        if mixture.schedule and mixture.sequences_per_step <= 0:
            raise ValueError("a mixture schedule needs sequences_per_step > 0")
        for s, w in zip(self.sources, self._weights[0][1], strict=True):
            if w > 0 and s.split.windows == 0:
                raise ValueError(
                    f"{shards_dir}: source {s.name!r} has no window of {seq_len + 1} tokens"
                )
        self._source_orders: dict[tuple[int, int], np.ndarray] = {}
        zeros = tuple(0 for _ in names)
        self._state = (0, zeros, zeros)  # (g, draws per source, credits per source)

    # -- drawing ---------------------------------------------------------------------------------
    def weights_at(self, g: int) -> tuple[int, ...]:
        """The integer weights in force at global position g (the schedule's by step)."""
        weights = self._weights[0][1]
        if len(self._weights) > 1:
            step = g // self.mixture.sequences_per_step
            for at, w in self._weights[1:]:
                if step >= at:
                    weights = w
        return weights

    def _source_order(self, s: int, epoch: int) -> np.ndarray:
        key = (s, epoch)
        if key not in self._source_orders:
            src = self.sources[s]
            order, _ = epoch_order(src.split, src.seed, epoch, self.shuffle_shards)
            self._source_orders[key] = order
            for old in [k for k in self._source_orders if k[0] == s and k[1] < epoch - 1]:
                del self._source_orders[old]
        return self._source_orders[key]

    def draw(self, state) -> tuple[np.ndarray, np.ndarray, tuple]:
        """The global batch from `state`: (source of each position, the source's draw index of
        each, the state after it)."""
        g, draws, credits = state
        n = self.batch_size * self.world_size
        credits, draws = list(credits), list(draws)
        src, k = [0] * n, [0] * n
        steady = self.weights_at(g) == self.weights_at(g + n - 1) and len(self._weights) < 3
        weights = self.weights_at(g)
        for i in range(n):
            s = assign(credits, weights if steady else self.weights_at(g + i))
            src[i], k[i] = s, draws[s]
            draws[s] += 1
        after = (g + n, tuple(draws), tuple(credits))
        return np.array(src, np.int64), np.array(k, np.int64), after

    def window_ids_of(self, src: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Window ids in the loader's split of each (source, draw index)."""
        ids = np.empty(len(src), np.int64)
        for s in np.unique(src):
            source = self.sources[int(s)]
            n_s = source.split.windows
            sel = np.flatnonzero(src == s)
            epoch, pos = np.divmod(k[sel], n_s)
            local = np.empty(len(sel), np.int64)
            for e in np.unique(epoch):
                here = epoch == e
                local[here] = self._source_order(int(s), int(e))[pos[here]]
            shard = np.searchsorted(source.split.window_start, local, side="right") - 1
            ids[sel] = self.split.window_start[source.shards[shard]] + (
                local - source.split.window_start[shard]
            )
        return ids

    def _batch(self, state):
        src, k, after = self.draw(state)
        if self.rank == 0:
            for s, kk in zip(src.tolist(), k.tolist(), strict=True):
                n_s = self.sources[s].split.windows
                if kk and kk % n_s == 0:
                    log.info(
                        "loader: source %r has given all its %d windows: its epoch %d starts, "
                        "reshuffled",
                        self.sources[s].name,
                        n_s,
                        kk // n_s,
                    )
        mine = slice(self.rank, None, self.world_size)
        ids = self.window_ids_of(src[mine], k[mine])
        if self.reader.remote:
            shards = np.searchsorted(self.split.window_start, ids, side="right") - 1
            self.reader.prefetch(list(dict.fromkeys(shards.tolist())))
        B, T = self.batch_size, self.seq_len
        x = torch.empty((B, T), dtype=torch.int64, pin_memory=self.pin)
        y = torch.empty((B, T), dtype=torch.int64, pin_memory=self.pin)
        gather(self.reader, ids, x.numpy(), y.numpy())
        return x, y, after

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        g, draws, credits = self._state
        # a mixture has no epoch of its own: each source has one
        d = self.order_settings()
        d["mixture"] = {
            "position": g,
            "weights": dict(zip(self._names, self.weights_at(g), strict=True)),
            "sources": {
                s.name: {
                    "drawn": n,
                    "epoch": n // s.split.windows,
                    "position": n % s.split.windows,
                    "windows": s.split.windows,
                    "credit": c,
                }
                for s, n, c in zip(self.sources, draws, credits, strict=True)
            },
        }
        return d

    @property
    def _names(self) -> list[str]:
        return [s.name for s in self.sources]

    def load_state_dict(self, d: dict) -> None:
        m = d.get("mixture")
        if not isinstance(m, dict):
            raise ValueError(
                "loader state was saved without train.data.mixture (one order over every "
                "window): resume without the mixture, or start a new run"
            )
        self.check_saved(d)
        saved = m.get("sources") or {}
        if sorted(saved) != sorted(self._names):
            raise ValueError(
                f"loader state was saved with the sources {sorted(saved)}, the shards have "
                f"{sorted(self._names)}: the data order would differ"
            )
        for s in self.sources:
            if int(saved[s.name]["windows"]) != s.split.windows:
                raise ValueError(
                    f"loader state: source {s.name!r} had {saved[s.name]['windows']} windows, "
                    f"now {s.split.windows}: the data order would differ"
                )
        g = int(m["position"])
        before = {k: int(v) for k, v in (m.get("weights") or {}).items()}
        if before and before != dict(zip(self._names, self.weights_at(g), strict=True)):
            log.warning(
                "loader: train.data.mixture differs from the checkpoint's: drawing goes on "
                "with the new weights from position %d",
                g,
            )
        self.close()
        self._state = (
            g,
            tuple(int(saved[n]["drawn"]) for n in self._names),
            tuple(int(saved[n]["credit"]) for n in self._names),
        )
