"""`codex data shard` writing to gs:// while its store is killed and back 1.5 s later (a real
emulator: tests/fixtures/gcs_emulator.py): each run ends with the local run's shards, or with one
`Error:` line (exit 1) after which a rerun does (codex/core/store.py)."""

from __future__ import annotations

import pytest

from codex.core import fsio
from tests.fixtures.clean import make_corpus
from tests.fixtures.outage import codex, codex_through_outage, one_error_line

pytestmark = [pytest.mark.gcs, pytest.mark.slow]

SHARD = ["--workers", "2", "--set", "data.shard.shard_tokens=3000"]


def shards_in(folder: str) -> dict[str, bytes]:
    return {fsio.basename(p): fsio.read_bytes(p) for p in fsio.glob(fsio.join(folder, "*.npy"))}


def test_a_shard_whose_store_restarts_mid_upload_ends_as_the_local_run(tmp_path, own_gcs_emulator):
    make_corpus(tmp_path / "in", 8, 60)
    run = str(tmp_path / "run")
    for args in (
        ["clean", "--input", str(tmp_path / "in"), "--set", "data.clean.chunk_bytes=20000"],
        ["tokenize", "--vocab-size", "300"],
        ["shard", *SHARD],
    ):
        res = codex("data", args[0], "--run", run, *args[1:])
        assert res.returncode == 0, res.stdout + res.stderr
    want = shards_in(fsio.join(run, "shards"))
    assert len(want) > 3
    bucket = own_gcs_emulator.new_bucket()
    for i, after in enumerate([1, 4, 8]):
        out = f"gs://{bucket}/s{i}"
        args = ["data", "shard", "--run", run, *SHARD, "--set", f"data.shard.out={out}"]
        markers = own_gcs_emulator.objects(bucket) / f"s{i}" / ".units" / "*" / "done.json"
        res, killed = codex_through_outage(own_gcs_emulator, args, markers, after)
        assert killed, f"the run ended before {after} markers:\n{res.stdout}{res.stderr}"
        if res.returncode != 0:
            assert bucket in one_error_line(res)
            rerun = codex(*args)
            assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        assert shards_in(out) == want, f"outage after {after} markers: not the local shards"
        print(f"shard, store killed after {after} unit markers: exit {res.returncode}")
