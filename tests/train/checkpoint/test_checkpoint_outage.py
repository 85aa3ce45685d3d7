"""A checkpoint save to gs:// whose store is killed mid-upload and back 0.5 s later (a real
emulator: tests/fixtures/gcs_emulator.py): the save goes on, or fails with one error naming the
store and the object (codex/core/store.py); saved again, the checkpoint is whole."""

from __future__ import annotations

import threading

import pytest
import torch

from codex.core import store
from codex.train.checkpoint import folders as checkpoint
from tests.fixtures.outage import train_through_outages

pytestmark = [pytest.mark.gcs, pytest.mark.slow]


def test_a_checkpoint_save_through_a_restart_of_its_store(own_gcs_emulator):
    run = f"gs://{own_gcs_emulator.new_bucket()}/run"
    w = torch.randn(12_000_000)  # 48 MB: its file goes up in several chunks of one session
    state = {"step": 1, "model": {"w": w}, "rng": checkpoint.rng_state()}
    failed: list[BaseException] = []

    def save() -> None:
        try:
            checkpoint.save(run, state)
        except Exception as e:  # noqa: BLE001 - judged below
            failed.append(e)

    saver = threading.Thread(target=save)
    saver.start()
    own_gcs_emulator.restart_mid_upload(saver)
    saver.join(300)
    if failed:  # one line naming the store and the object; the next save starts clean
        assert isinstance(failed[0], store.StoreError), repr(failed[0])
        assert str(failed[0]).startswith("gs://") and "\n" not in str(failed[0])
        checkpoint.save(run, state)
    assert checkpoint.complete_steps(run) == [1]
    assert torch.equal(checkpoint.load(run)["model"]["w"], w)


def test_codex_train_whose_store_restarts_mid_save_ends_as_the_local_run(
    tmp_path, own_gcs_emulator
):
    # The store goes down inside the first save, then inside the last (4 saves; the watch sees
    # 3 objects of each); bench/bench_store_outage.py --stage train runs 10 points.
    for end in train_through_outages(tmp_path, own_gcs_emulator, [1, 10]):
        print("codex train,", end)
