"""Validation cannot deadlock in any layout (issue 29): with several ranks every rank runs the same
number of validation forwards (masked filler rows where it has no window left), so a sharded
model's per-forward all-gather always has every rank in it; and the loss is the one of replicate
and of one process, the filler rows counting nothing.

The window count n = 9 is chosen so that n mod (B*W) is in [1, W-1]: the last step has a window
for rank 0 only. Before the fix the other ranks skipped that step and waited in the loss
all-reduce while rank 0 waited for them in an FSDP all-gather, until the collective timeout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from codex.train.data.loader import val_batches, val_window_ids
from tests.fixtures.runs import child_env, make_run, run_train, train_cli_args

ROOT = Path(__file__).resolve().parents[3]
T = 16
WINDOWS = 9  # 9 mod (B*W = 8) = 1, in [1, W-1] for W = 2 (B = 4) and W = 4 (B = 2)
# One optimizer step, then validation: the same 8-row global batch in every layout, and a tiny lr
# so that every layout validates (nearly bitwise) the same weights: the loss comparison is then a
# test of validation, not of how summation order in the gradient reduction moves Adam's update.
KEYS = dict(max_steps=1, warmup_steps=0, eval_every=1, lr=1e-6, eval_tokens=T * WINDOWS, seq_len=T)
DEADLOCK_S = 180  # a hung run fails the test instead of waiting for the collective timeout


# --- the batch arithmetic ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "B", "W"),
    [(9, 4, 2), (9, 2, 4), (10, 2, 4), (11, 2, 4), (8, 4, 2), (1, 3, 3), (17, 1, 5), (5, 4, 1)],
)
def test_every_rank_gets_the_same_count_and_the_real_rows_are_every_window_once(n, B, W):
    per_rank = [val_window_ids(n, B, r, W) for r in range(W)]
    steps = -(-n // (B * W))
    assert [len(batches) for batches in per_rank] == [steps] * W
    assert all(ids.shape == (B,) for batches in per_rank for ids in batches)
    real = np.concatenate([ids for batches in per_rank for ids in batches])
    assert sorted(real[real >= 0].tolist()) == list(range(n))  # every window, each once
    assert set(real[real < 0].tolist()) <= {-1}  # the rest is filler
    # rank r's row k of step g is window g*B*W + r + k*W, as in training; -1 past the end
    for r, batches in enumerate(per_rank):
        for g, ids in enumerate(batches):
            want = [g * B * W + r + k * W for k in range(B)]
            assert ids.tolist() == [w if w < n else -1 for w in want]
    if n % (B * W) in range(1, W):  # the case that deadlocked: some rank has only filler
        assert any((batches[-1] < 0).all() for batches in per_rank)


def test_val_batches_with_several_ranks_are_masked_and_equal_count(tmp_path):
    """val_batches over 2 ranks without with_mask (CPU/CUDA): full masked batches, the same count
    on both ranks, the unmasked rows being the first WINDOWS windows; one process keeps (x, y)
    with a smaller last batch."""
    shards = os.path.join(make_run(tmp_path), "shards")
    per_rank = [
        list(val_batches(shards, T, 4, rank=r, world_size=2, max_tokens=T * WINDOWS))
        for r in range(2)
    ]
    assert [len(b) for b in per_rank] == [2, 2]
    assert all(len(b) == 3 and b[0].shape == (4, T) for batches in per_rank for b in batches)
    assert [int(b[2].sum()) for b in per_rank[1]] == [4, 0]  # rank 1: nothing left at step 2
    one = list(val_batches(shards, T, 8, max_tokens=T * WINDOWS))
    assert [len(b) for b in one] == [2, 2] and [b[0].shape[0] for b in one] == [8, 1]
    rows = {tuple(row.tolist()) for x, _ in one for row in x}
    real = {
        tuple(row.tolist()) for batches in per_rank for x, _, mask in batches for row in x[mask]
    }
    assert real == rows and len(rows) == WINDOWS


# --- validation under fsdp and HSDP, 2 and 4 gloo ranks ----------------------------------------


def torchrun(run: str, nproc: int, **train_keys) -> None:
    """`codex train` under torchrun; killed (torchrun and its workers) and failed after DEADLOCK_S,
    so a deadlocked validation fails the test rather than hanging it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", "-m", "codex.cli", "--", "train"]
    cmd += train_cli_args(run, **train_keys)
    proc = subprocess.Popen(
        cmd,
        env=child_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=DEADLOCK_S)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: kill them by pid, then torchrun
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{nproc} ranks {train_keys}: no exit in {DEADLOCK_S} s (validation deadlock)")
    assert proc.returncode == 0, err[-4000:]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def val_line(run: str) -> dict:
    lines = Path(run, "metrics.jsonl").read_text().splitlines()
    (val,) = [r for r in map(json.loads, lines) if r["kind"] == "val"]
    return val


@pytest.mark.slow
def test_validation_under_fsdp_and_hsdp_finishes_and_equals_replicate_and_one_process(tmp_path):
    """fsdp over 2 ranks (4 rows each) and HSDP 2 replicas x 2 shards over 4 ranks (2 rows each):
    the last validation step has a window for rank 0 only, every other rank runs it on filler.
    (train.fsdp_size=1 on 2 ranks is a 2 x 1 mesh that shards nothing, so its forward gathers
    nothing and could never deadlock here: the 4-rank mesh is the HSDP case that can.)"""
    layouts = {
        "fsdp": (2, dict(parallel="fsdp", device_batch=4)),
        "hsdp": (4, dict(parallel="fsdp", fsdp_size=2, device_batch=2)),
        "replicate": (2, dict(parallel="replicate", device_batch=4)),
    }
    runs = {name: make_run(tmp_path / name) for name in [*layouts, "one"]}
    for name, (nproc, keys) in layouts.items():
        torchrun(runs[name], nproc, **KEYS, **keys)
    run_train(runs["one"], **KEYS, device_batch=8)
    val = {name: val_line(run) for name, run in runs.items()}
    for name, rec in val.items():
        assert rec["step"] == 1 and rec["val_tokens"] == T * WINDOWS, name
        assert abs(rec["loss"] - val["one"]["loss"]) < 1e-6, (name, rec["loss"], val["one"])
        assert abs(rec["bits_per_byte"] - val["one"]["bits_per_byte"]) < 1e-6, name
    assert abs(val["fsdp"]["loss"] - val["replicate"]["loss"]) < 1e-6
    assert abs(val["hsdp"]["loss"] - val["replicate"]["loss"]) < 1e-6
