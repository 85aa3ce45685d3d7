"""Each stage writing to gs:// while its object store (a real GCS emulator, objects on disk) is
killed at --points points and back 1.5 s later: `codex data clean` (after N unit markers),
`codex data shard` (after N unit markers), `codex train` (after N checkpoint objects). Each run
ends as the local run (the same bytes; for train the same losses and weights), or with one
`Error:` line (exit 1) after which a rerun does (tests/fixtures/outage.py). Then a store that
never comes back, at --bound seconds of store_timeout_s: how long until its one line.

    python bench/bench_store_outage.py                  # every stage, 10 points each
    python bench/bench_store_outage.py --stage train --points 5 --bound 5

Results: docs/bad-input.md, "An object store that fails".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from tests.fixtures.clean import make_corpus  # noqa: E402
from tests.fixtures.gcs_emulator import Emulator  # noqa: E402
from tests.fixtures.outage import (  # noqa: E402
    clean_through_outages,
    codex,
    one_error_line,
    shard_through_outages,
    train_through_outages,
)

# Where each stage's store goes down: clean after 1, 3, ... unit markers (23 units), shard after
# 1, 2, ... unit markers, train after 1, 2, 3, ... checkpoint objects (4 saves; the watch's glob
# sees 3 objects of each, .metadata being hidden from it).
STAGES = {
    "clean": (clean_through_outages, lambda i: 1 + 2 * i),
    "shard": (shard_through_outages, lambda i: 1 + i),
    "train": (train_through_outages, lambda i: 1 + 11 * i // 9),
}
from tests.fixtures.procs import free_port  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=10)
    ap.add_argument("--bound", type=float, default=10.0, help="store_timeout_s of the dead store")
    ap.add_argument("--stage", choices=[*STAGES, "all"], default="all")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        emu = Emulator(Path(tmp) / "gcs").start()
        os.environ["STORAGE_EMULATOR_HOST"] = emu.url
        try:
            for stage, (through_outages, point) in STAGES.items():
                if args.stage not in (stage, "all"):
                    continue
                started = time.monotonic()
                points = [point(i) for i in range(args.points)]
                for line in through_outages(Path(tmp) / stage, emu, points):
                    print(f"{stage}: {line}", flush=True)
                print(f"{stage}: {args.points} outages in {time.monotonic() - started:.0f} s")
        finally:
            emu.stop()
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{free_port()}"
        make_corpus(Path(tmp) / "small", 2, 5)
        started = time.monotonic()
        res = codex(
            *("data", "clean", "--run", "gs://gone/r", "--input", str(Path(tmp) / "small")),
            *("--set", f"store_timeout_s={args.bound:g}"),
        )
        took = time.monotonic() - started
        print(f"dead store, store_timeout_s={args.bound:g}: {took:.1f} s to {one_error_line(res)}")


if __name__ == "__main__":
    main()
