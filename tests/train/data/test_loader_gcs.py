"""gs:// shards read by several processes on one host through the shared shard cache: no rank
loses a file to another rank's eviction, each shard is downloaded once per host, and only by a
rank whose own windows touch it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from codex.train.data.loader import epoch_order
from codex.train.data.token_shards import load_split
from tests.fixtures import ROOT
from tests.fixtures.loader import T, upload_dir, write_shards

# One rank of the test, as a trainer runs it: the per-step barrier stands for the gradient
# all-reduce that keeps real ranks in lockstep. fsio.download is wrapped so the downloads are
# counted outside the code under test.
CHILD = r"""
import datetime, faulthandler, json, os, sys
import torch, torch.distributed as dist
from codex.core import fsio

a = json.loads(sys.argv[1])
faulthandler.dump_traceback_later(a["timeout"], exit=True)  # a hang shows every thread's stack
downloads = []
_download = fsio.download
def counting_download(src, dst):
    downloads.append(fsio.basename(src))
    _download(src, dst)
fsio.download = counting_download
from codex.train.data.loader import TrainLoader

r, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="file://" + a["pg"], rank=r, world_size=W,
                        timeout=datetime.timedelta(seconds=a["timeout"]))
ld = TrainLoader(a["remote"], a["T"], a["B"], rank=r, world_size=W, seed=a["seed"],
                 shuffle_shards=a["K"], cache_dir=a["cache"])
ref = TrainLoader(a["local"], a["T"], a["B"], rank=r, world_size=W, seed=a["seed"],
                  shuffle_shards=a["K"], prefetch=0)
firsts, most = [], 0
for step in range(a["steps"]):
    x, y = next(ld)
    rx, ry = next(ref)
    if not (torch.equal(x, rx) and torch.equal(y, ry)):
        sys.exit(f"rank {r} step {step}: the gs:// batch differs from the local one")
    firsts += x[:, 0].tolist()
    dist.barrier()
    most = max(most, len([f for f in os.listdir(a["cache"]) if f.startswith("train_")]))
ld.close()
out = {"downloads": downloads, "firsts": firsts, "most_files": most, "state": ld.state_dict()}
with open(a["out"] % r, "w") as f:
    json.dump(out, f)
dist.barrier()
dist.destroy_process_group()
"""


def run_ranks(args: dict, world: int) -> list[dict]:
    """Start `world` ranks of CHILD on this host (one shared cache folder); their reports. A rank
    that fails ends the others (they would wait for it at the barrier)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    logs = [open(args["out"] % r + ".log", "w+") for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            cwd=str(ROOT),
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    deadline = time.time() + args["timeout"] + 30
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(2)  # let the others report their side, then stop them
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    failed = []
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        log.seek(0)
        if p.returncode != 0:
            failed.append(f"rank {r} rc={p.returncode}:\n{log.read()[-6000:]}")
        log.close()
    assert not failed, "\n".join(failed)
    return [json.load(open(args["out"] % r)) for r in range(world)]


@pytest.mark.slow
@pytest.mark.gcs
# block shuffle with a cache of 2K = 2; full shuffle
@pytest.mark.parametrize("K,steps", [(1, 200), (0, 30)])
def test_three_ranks_share_one_bounded_cache_and_download_each_shard_once(
    tmp_path, gcs_bucket, K, steps
):
    W, B, seed = 3, 2, 5
    # 10 shards of 160 windows: 200 steps of B*W = 6 windows read 1200 of the epoch's 1600, so
    # within the run no shard comes round again and each should be downloaded exactly once.
    local = write_shards(tmp_path / "local", {"train": [160 * T + 1] * 10, "val": [3 * T + 1]})
    remote = f"{gcs_bucket}/run/shards"
    upload_dir(local, remote)
    args = {
        "remote": remote,
        "local": local,
        "cache": str(tmp_path / "cache"),
        "pg": str(tmp_path / "pg"),
        "out": str(tmp_path / "rank%d.json"),
        "T": T,
        "B": B,
        "K": K,
        "steps": steps,
        "seed": seed,
        "timeout": 60,
    }
    reports = run_ranks(args, W)

    split = load_split(local, "train", T)
    starts = 7 + np.concatenate([[0], np.cumsum(split.tokens)])  # write_shards' token counter
    read = [
        set((np.searchsorted(starts, rep["firsts"], side="right") - 1).tolist()) for rep in reports
    ]
    host_read = set().union(*read)
    # The block after the last step's is prefetched for the step that would come next.
    order, blocks = epoch_order(split, seed, 0, K)
    last = (steps - 1) * B * W
    k = next(i for i, (a, b, _) in enumerate(blocks) if a <= last < b)
    ahead = {int(s) for blk in blocks[k : k + 2] for s in blk[2]}
    names = [os.path.basename(p) for p in split.paths]
    fetched = [[names.index(n) for n in rep["downloads"]] for rep in reports]
    host = [s for f in fetched for s in f]
    assert len(host) == len(set(host)), f"a shard was downloaded twice on the host: {sorted(host)}"
    assert host_read <= set(host)  # nothing read from anywhere but this host's own downloads
    assert len(host) <= len(host_read) + K and set(host) <= host_read | ahead, (
        sorted(host),
        sorted(host_read),
    )
    for r in range(W):  # a rank downloads only what its own windows read (or the block after)
        assert set(fetched[r]) <= read[r] | ahead, (r, fetched[r], sorted(read[r]))
    # The block shuffle keeps 2K files (3K while straddling a block boundary); the full shuffle
    # all 10.
    assert max(rep["most_files"] for rep in reports) <= (3 * K if K else 10)
    assert all(rep["state"] == reports[0]["state"] for rep in reports)
