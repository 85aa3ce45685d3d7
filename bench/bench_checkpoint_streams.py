"""A host's checkpoint write rate with one stream and with N, to the local disk and to the GCS
emulator, side by side in one run: what train/plan/save_time.py's HOST_WRITE_RATE comes from.

    PYTHONPATH=. python bench/bench_checkpoint_streams.py                 # 0.5 GB, 1 vs 16
    PYTHONPATH=. python bench/bench_checkpoint_streams.py --gb 2 --gs gs://BUCKET/tmp  # real GCS

A save: train/checkpoint/folders.py: save in one process (one host's share: DCP's files, then
state.json and DONE with every file's sha256) of 32 MB fp32 tensors, through
train/checkpoint/streams.py with STREAMS set to 1 or N. Rows: 1 stream (one file, as before
streams); the N streams' files written one after another (the same objects, no concurrency); N
streams. gs:// is the tests' emulator (tests/fixtures/gcs_emulator.py), in memory: one
single-threaded server that copies an upload's received bytes at every chunk, so one large
object is slow there for reasons of its own. Each row is the best of --repeat saves, the saves
interleaved so the machine's load falls on every row.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from codex.core import fsio  # first: its gcsfs settings, before gcsfs is imported

GB = 1e9
TENSOR = 8 << 20  # elements: 32 MB of fp32 a tensor


def state(gb: float) -> dict:
    n = max(1, round(gb * GB / (4 * TENSOR)))
    torch.manual_seed(0)
    return {"step": 1, "model": {f"w{i}": torch.rand(TENSOR) for i in range(n)}}


def nbytes(tree: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tree["model"].values())


class _InCallerThread:
    """threading.Thread that runs its target in start(): the streams' files one after another."""

    def __init__(self, target, daemon: bool = False) -> None:
        self.target = target

    def start(self) -> None:
        self.target()

    def join(self) -> None:
        pass


def one_save(run: str, tree: dict, n: int, serial: bool) -> float:
    """Seconds to save `tree` in `n` streams; serial: the same n files written one at a time."""
    from codex.train.checkpoint import folders as checkpoint
    from codex.train.checkpoint import streams

    streams.STREAMS, streams.STREAM_BYTES = n, 1
    streams.Thread = _InCallerThread if serial else threading.Thread  # type: ignore[misc]
    if fsio.exists(run):
        fsio.rm(run, recursive=True)
    t = time.perf_counter()
    folder = checkpoint.save(run, tree, keep_last=1)
    seconds = time.perf_counter() - t
    files = [f for f in fsio.listdir(folder) if str(f).endswith(".distcp")]
    assert len(files) == min(n, len(tree["model"])), (n, files)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=0.5, help="checkpoint size (one host's share)")
    ap.add_argument("--streams", type=int, default=16, help="N: the streams to compare with 1")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="local folder (default: a temp folder in /tmp)")
    ap.add_argument("--gs", default="", help="a real gs://BUCKET/PREFIX instead of the emulator")
    ap.add_argument("--skip-gcs", action="store_true", help="the local disk only")
    ap.add_argument(
        "--emulator-on-disk",
        action="store_true",
        help="the emulator keeps objects on disk (default: in memory)",
    )
    args = ap.parse_args()
    n = args.streams
    rows = [("1 stream, 1 file", 1, False), (f"{n} files, 1 at a time", n, True)]
    rows.append((f"{n} streams", n, False))
    base = tempfile.mkdtemp(prefix="bench-ckpt-streams-", dir=args.dir)
    tree = state(args.gb)
    size = nbytes(tree)
    emulator = None
    places = {"local disk": os.path.join(base, "run")}
    if args.gs:
        places[args.gs] = fsio.join(args.gs, f"bench-ckpt-streams-{os.getpid()}")
    elif not args.skip_gcs:
        from tests.fixtures.gcs_emulator import Emulator

        on_disk = Path(base) / "emulator" if args.emulator_on_disk else None
        emulator = Emulator(data_dir=on_disk).start()
        os.environ["STORAGE_EMULATOR_HOST"] = emulator.url
        places["gs:// (emulator)"] = f"gs://{emulator.new_bucket()}/run"
    load = os.getloadavg()[0]
    best: dict[tuple[str, str], float] = {}
    try:
        for _ in range(args.repeat):
            for place, run in places.items():
                for row, count, serial in rows:
                    s = one_save(run, tree, count, serial)
                    best[place, row] = min(best.get((place, row), s), s)
                    print(f"  {place:18} {row:22} {s:7.2f} s", flush=True)
    finally:
        if emulator is not None:
            emulator.stop()
        shutil.rmtree(base, ignore_errors=True)
        if args.gs and fsio.exists(places[args.gs]):
            fsio.rm(places[args.gs], recursive=True)
    print(
        f"\n{size / GB:.2f} GB, {os.cpu_count()} CPUs, 1-minute load average {load:.1f} before "
        f"and {os.getloadavg()[0]:.1f} after; the best of {args.repeat}\n"
    )
    print("| destination | writer | GB | seconds | GB/s | vs 1 stream |")
    print("|---|---|---:|---:|---:|---:|")
    for place in places:
        one = best[place, rows[0][0]]
        for row, _, _ in rows:
            s = best[place, row]
            print(
                f"| {place} | {row} | {size / GB:.2f} | {s:.2f} | {size / GB / s:.3f} | "
                f"{one / s:.2f}x |"
            )


if __name__ == "__main__":
    main()
