"""A rank's checkpoint share written in several streams at once (train/checkpoint/streams.py):
read back exactly, locally and on gs://; one failed stream fails the save, which then has no index
and no DONE. And `codex train` warns at start when a save cannot end within a preemption's notice
(train.preempt_notice_s; the decision: tests/train/plan/test_save_time.py)."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
import torch

from codex.train.checkpoint import dcp, streams
from codex.train.checkpoint import folders as checkpoint
from tests.fixtures.bad_input import TRAIN, invoke
from tests.fixtures.runs import make_run


@pytest.fixture
def small_streams(monkeypatch):
    """A stream per 4 KB: the tiny states below are written in several."""
    monkeypatch.setattr(streams, "STREAM_BYTES", 4096)


def _state(step: int) -> dict:
    torch.manual_seed(step)
    model = {f"w{i}": torch.randn(1000 + 7 * i) for i in range(6)}
    return {"step": step, "model": model, "rng": checkpoint.rng_state()}


def _round_trip(run: str) -> list[str]:
    """Save and load one state; the names of its .distcp files."""
    state = _state(1)
    folder = checkpoint.save(run, state)
    back = checkpoint.load(run)
    for k, v in state["model"].items():
        assert torch.equal(back["model"][k], v), k
    done = json.loads(checkpoint.fsio.read_bytes(checkpoint.fsio.join(folder, "DONE")))
    files = sorted(f for f in done["files"] if f.endswith(".distcp"))
    return files


def test_a_share_in_several_streams_reads_back_exactly(tmp_path, small_streams):
    files = _round_trip(str(tmp_path / "run"))
    assert len(files) > 1
    on_disk = sorted(p.name for p in tmp_path.glob("run/checkpoints/step_*/*.distcp"))
    assert on_disk == files  # DONE vouches for every stream's file


def test_a_small_share_stays_one_file():
    assert streams.streams_for(streams.STREAM_BYTES - 1, 100) == 1
    assert streams.streams_for(100 * streams.STREAM_BYTES, 3) == 3  # a file a tensor at most
    assert streams.streams_for(10**15, 10**6) == streams.STREAMS


def test_one_failed_stream_fails_the_save_with_no_index_and_no_done(
    tmp_path, small_streams, monkeypatch
):
    write = dcp._HashingStream.write

    def full_disk_on_one_file(self, b):
        if self.path.endswith("__0_2.distcp"):
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return write(self, b)

    monkeypatch.setattr(dcp._HashingStream, "write", full_disk_on_one_file)
    run = str(tmp_path / "run")
    with pytest.raises(OSError) as e:
        checkpoint.save(run, _state(1))
    assert e.value.errno == errno.ENOSPC and "__0_2.distcp" in str(e.value)
    folder = Path(checkpoint.step_dir(run, 1))
    assert not (folder / ".metadata").exists() and not (folder / "DONE").exists()
    assert checkpoint.complete_steps(run) == []


@pytest.mark.gcs
def test_a_share_in_several_streams_on_gcs(gcs_bucket, small_streams):
    assert len(_round_trip(f"{gcs_bucket}/run")) > 1


@pytest.mark.slow
def test_codex_train_warns_when_a_save_cannot_end_within_the_notice(tmp_path, caplog):
    run = make_run(tmp_path)
    args = ["train", "--run", run, *TRAIN, "--max-steps", "1"]
    with caplog.at_level(logging.WARNING, logger="codex.train"):
        invoke([*args, "--set=train.preempt_notice_s=0.000001"], 0)
    (line,) = [r.getMessage() for r in caplog.records if "preempt_notice_s" in r.getMessage()]
    assert "cannot finish within train.preempt_notice_s=1e-06 s" in line
    assert "GB/s to the local disk" in line and "more hosts" in line
