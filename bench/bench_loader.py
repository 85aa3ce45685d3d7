"""Loader throughput: tokens/s for B x T = 64 x 1024 from local npy shards, on one core.

    python bench/bench_loader.py [--tokens 64_000_000] [--steps 300]

Shards are built from the bytes of the Python stdlib .py files (one byte = one uint16 token,
repeated to the wanted size) in a temp dir. Reports the batch-building path alone (prefetch=0,
what the background thread does per batch) and what a consumer sees through the prefetch thread,
for the full shuffle and for a block shuffle (shuffle_shards=2). Target: >= 20M tokens/s.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from codex.train.data.loader import TrainLoader  # noqa: E402


def build_shards(root: str, n_tokens: int, shard_tokens: int) -> None:
    data = bytearray()
    for path in sorted(
        glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)
    ):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= n_tokens:
            break
    base = np.frombuffer(bytes(data), dtype=np.uint8).astype(np.uint16)
    tokens = np.resize(base, n_tokens)  # repeat if the stdlib is smaller than asked
    shards = []
    for i, start in enumerate(range(0, n_tokens, shard_tokens)):
        name = f"train_{i:05d}.npy"
        np.save(os.path.join(root, name), tokens[start : start + shard_tokens])
        shards.append(
            {
                "split": "train",
                "path": name,
                "format": "npy",
                "tokens": int(min(shard_tokens, n_tokens - start)),
                "documents": 1,
                "sha256": None,
            }
        )
    manifest = {
        "format_version": 1,
        "tokenizer": {"sha256": hashlib.sha256(b"bytes").hexdigest(), "vocab_size": 256},
        "special_ids": {},
        "dtype": "uint16",
        "append_eos": False,
        "val_fraction": 0.0,
        "shards": shards,
        "totals": {},
    }
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def measure(shards: str, B: int, T: int, steps: int, **kw) -> float:
    loader = TrainLoader(shards, T, B, seed=0, **kw)
    for _ in range(5):  # warm up: permutation, first mmaps, thread start
        next(loader)
    t0 = time.perf_counter()
    n = 0
    for _ in range(steps):
        x, y = next(loader)
        n += x.numel()
    dt = time.perf_counter() - t0
    loader.close()
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64_000_000)
    ap.add_argument("--shard-tokens", type=int, default=8_000_000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("-B", type=int, default=64)
    ap.add_argument("-T", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # one core: the loader must keep up on the one core a host spares it
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    with tempfile.TemporaryDirectory() as root:
        build_shards(root, args.tokens, args.shard_tokens)
        print(
            f"shards: {args.tokens / 1e6:.0f}M tokens in {args.tokens // args.shard_tokens} files, "
            f"B x T = {args.B} x {args.T}, one core, page cache warm"
        )
        print(f"{'mode':<44} {'M tokens/s':>10}")
        for label, kw in [
            ("full shuffle, batch building (prefetch=0)", dict(prefetch=0)),
            ("full shuffle, consumer via prefetch thread", dict(prefetch=4)),
            ("block shuffle of 2 shards (prefetch=0)", dict(prefetch=0, shuffle_shards=2)),
            ("block shuffle of 2 shards, prefetch thread", dict(prefetch=4, shuffle_shards=2)),
        ]:
            print(f"{label:<44} {measure(root, args.B, args.T, args.steps, **kw) / 1e6:>10.1f}")


if __name__ == "__main__":
    main()
