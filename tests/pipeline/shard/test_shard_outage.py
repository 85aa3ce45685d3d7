"""`codex data shard` writing to gs:// while its store is killed and back 1.5 s later (a real
emulator: tests/fixtures/gcs_emulator.py): each run ends with the local run's shards, or with one
`Error:` line (exit 1) after which a rerun does (codex/core/store.py)."""

from __future__ import annotations

import pytest

from tests.fixtures.outage import shard_through_outages

pytestmark = [pytest.mark.gcs, pytest.mark.slow]


def test_a_shard_whose_store_restarts_mid_upload_ends_as_the_local_run(tmp_path, own_gcs_emulator):
    # bench/bench_store_outage.py --stage shard runs 10 points.
    for end in shard_through_outages(tmp_path, own_gcs_emulator, [1, 4, 8]):
        print("shard,", end)
