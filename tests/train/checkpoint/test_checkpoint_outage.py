"""A checkpoint save to gs:// whose store is killed mid-upload and back 0.5 s later (a real
emulator: tests/fixtures/gcs_emulator.py): the save goes on, or fails with one error naming the
store and the object (codex/core/store.py); saved again, the checkpoint is whole."""

from __future__ import annotations

import threading

import pytest
import torch

from codex.core import store
from codex.train.checkpoint import folders as checkpoint
from codex.train.checkpoint import streams
from tests.fixtures.outage import train_through_outages

pytestmark = [pytest.mark.gcs, pytest.mark.slow]


def test_a_checkpoint_save_through_a_restart_of_its_store(own_gcs_emulator):
    # 48 MB: its file goes up in several chunks of one session
    _save_through_a_restart(own_gcs_emulator, {"w": torch.randn(12_000_000)})


def test_a_save_in_several_streams_through_a_restart_of_its_store(own_gcs_emulator, monkeypatch):
    # 4 x 24 MB, a stream each (train/checkpoint/streams.py): several uploads in flight when it
    # goes down
    monkeypatch.setattr(streams, "STREAM_BYTES", 16 << 20)
    _save_through_a_restart(own_gcs_emulator, {f"w{i}": torch.randn(6_000_000) for i in range(4)})


def _save_through_a_restart(emulator, model: dict) -> None:
    run = f"gs://{emulator.new_bucket()}/run"
    state = {"step": 1, "model": model, "rng": checkpoint.rng_state()}
    failed: list[BaseException] = []

    def save() -> None:
        try:
            checkpoint.save(run, state)
        except Exception as e:  # noqa: BLE001 - judged below
            failed.append(e)

    saver = threading.Thread(target=save)
    saver.start()
    emulator.restart_mid_upload(saver)
    saver.join(300)
    if failed:  # one line naming the store and the object; the next save starts clean
        assert isinstance(failed[0], store.StoreError), repr(failed[0])
        assert str(failed[0]).startswith("gs://") and "\n" not in str(failed[0])
        checkpoint.save(run, state)
    assert checkpoint.complete_steps(run) == [1]
    loaded = checkpoint.load(run)["model"]
    for k, w in model.items():
        assert torch.equal(loaded[k], w), k


def test_codex_train_whose_store_restarts_mid_save_ends_as_the_local_run(
    tmp_path, own_gcs_emulator
):
    # The store goes down inside the first save, then inside the last (4 saves; the watch sees
    # 3 objects of each); bench/bench_store_outage.py --stage train runs 10 points.
    for end in train_through_outages(tmp_path, own_gcs_emulator, [1, 10]):
        print("codex train,", end)
