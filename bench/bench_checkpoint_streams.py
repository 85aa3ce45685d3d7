"""A host's checkpoint write rate with one stream and with N, to the local disk and to the GCS
emulator, side by side in one run: what train/plan/save_time.py's HOST_WRITE_RATE comes from.

    PYTHONPATH=. python bench/bench_checkpoint_streams.py                 # 1 GB, streams 1 and 16
    PYTHONPATH=. python bench/bench_checkpoint_streams.py --gb 2 --streams 1,4,16 --repeat 3

A save is train/checkpoint/folders.py: save in one process (one host's share: DCP's files, then
state.json and DONE with every file's sha256), of a state of 32 MB fp32 tensors. The writer is
train/checkpoint/streams.py with STREAMS set to each count (and STREAM_BYTES to 1, so the count
is the streams). gs:// is the emulator the tests run (tests/fixtures/gcs_emulator.py), its
objects on disk under --dir: one single-threaded HTTP server on this machine, so it bounds what
N streams can gain there; a real store serves each stream on its own. Each row: the best of
--repeat saves; the order of the saves is interleaved, so the machine's load falls on all rows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

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


def one_save(run: str, tree: dict, n: int) -> float:
    from codex.train.checkpoint import folders as checkpoint
    from codex.train.checkpoint import streams

    streams.STREAMS, streams.STREAM_BYTES = n, 1
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
    ap.add_argument("--gb", type=float, default=1.0, help="checkpoint size (one host's share)")
    ap.add_argument("--streams", default="1,16", help="stream counts, comma separated")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="local folder (default: a temp folder in /tmp)")
    ap.add_argument("--skip-gcs", action="store_true")
    args = ap.parse_args()
    counts = [int(c) for c in args.streams.split(",")]
    base = tempfile.mkdtemp(prefix="bench-ckpt-streams-", dir=args.dir)
    tree = state(args.gb)
    size = nbytes(tree)
    emulator = None
    places = {"local disk": os.path.join(base, "run")}
    if not args.skip_gcs:
        from tests.fixtures.gcs_emulator import Emulator

        emulator = Emulator(data_dir=__import__("pathlib").Path(base) / "emulator").start()
        os.environ["STORAGE_EMULATOR_HOST"] = emulator.url
        places["gs:// (emulator)"] = f"gs://{emulator.new_bucket()}/run"
    load = os.getloadavg()[0]
    best: dict[tuple[str, int], float] = {}
    try:
        for _ in range(args.repeat):
            for place, run in places.items():
                for n in counts:
                    s = one_save(run, tree, n)
                    best[place, n] = min(best.get((place, n), s), s)
                    print(f"  {place:18} {n:3d} streams  {s:7.2f} s", flush=True)
    finally:
        if emulator is not None:
            emulator.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"\n{size / GB:.2f} GB, {os.cpu_count()} CPUs, 1-minute load average {load:.1f} before "
        f"and {os.getloadavg()[0]:.1f} after; the best of {args.repeat}\n"
    )
    print("| destination | streams | GB | seconds | GB/s | vs 1 stream |")
    print("|---|---:|---:|---:|---:|---:|")
    for place in places:
        one = best.get((place, counts[0]))
        for n in counts:
            s = best[place, n]
            ratio = f"{one / s:.2f}x" if one else "-"
            print(f"| {place} | {n} | {size / GB:.2f} | {s:.2f} | {size / GB / s:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
