"""train/checkpoint/folders.py: a damaged or truncated checkpoint falls back (an I/O error is
retried instead), retention keeps the intact ones, the DCP + JSON layout, round trips and resume on
gs://. Several ranks and layouts: tests/train/distributed/test_fsdp.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from codex.train.checkpoint import folders as checkpoint
from tests.fixtures.runs import child_env, make_run, one_thread, run_train, train_cli_args  # noqa: F401  (one_thread: autouse)


def _state(step: int) -> dict:
    return {
        "step": step,
        "tokens": step * 10,
        "model": {"w": torch.full((64,), float(step))},
        "config": {"train": {"lr": 0.1}},
        "rng": checkpoint.rng_state(),
    }


def _shard(run: str, step: int) -> Path:
    return Path(checkpoint.step_dir(run, step)) / "__0_0.distcp"


def test_truncated_or_corrupt_latest_checkpoint_falls_back(tmp_path, caplog):
    run = str(tmp_path / "run")
    for s in (1, 2, 3):
        checkpoint.save(run, _state(s), keep_last=5)
    shard3 = _shard(run, 3)
    data = shard3.read_bytes()
    shard3.write_bytes(data[: len(data) // 2])  # truncated
    assert checkpoint.latest_step(run) == 3
    state = checkpoint.load(run)
    assert state["step"] == 2 and torch.equal(state["model"]["w"], torch.full((64,), 2.0))
    assert "step_00000003" in caplog.text and "damaged" in caplog.text
    with pytest.raises(ValueError, match="truncated"):
        checkpoint.load(run, 3)  # an explicit step is never swapped
    shard3.write_bytes(b"\0" * len(data))  # right size, garbage content: the sha256 differs
    assert checkpoint.load(run)["step"] == 2
    (Path(checkpoint.step_dir(run, 2)) / ".metadata").unlink()  # a file DONE lists is gone
    assert checkpoint.load(run)["step"] == 1
    # an old ckpt.pt checkpoint
    (Path(checkpoint.step_dir(run, 1)) / "DONE").write_text('{"step": 1, "bytes": 100}')
    with pytest.raises(ValueError, match="single-file checkpoint of an older codex"):
        checkpoint.load(run)


def test_a_checkpoint_holds_tensors_in_dcp_and_the_rest_in_json(tmp_path):
    run = str(tmp_path / "run")
    state = _state(4) | {
        "optimizer": {
            "adamw": {
                "state": {"w": {"exp_avg": torch.ones(64), "step": torch.tensor(3.0)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}],
            }
        }
    }
    checkpoint.save(run, state)
    folder = Path(checkpoint.step_dir(run, 4))
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata",
        "DONE",
        "__0_0.distcp",
        "state.json",
    ]
    skeleton = json.loads((folder / "state.json").read_text())
    assert (
        skeleton["model"]["w"] == {"__tensor__": [64], "dtype": "float32"}
        and skeleton["tokens"] == 40
    )
    back = checkpoint.load(run, 4)
    assert back["optimizer"]["adamw"]["param_groups"][0]["betas"] == [0.9, 0.95]
    assert torch.equal(back["optimizer"]["adamw"]["state"]["w"]["step"], torch.tensor(3.0))
    only_model = checkpoint.load(run, 4, keys=("model",))
    assert (
        "optimizer" not in only_model
        and "rng" not in only_model
        and only_model["config"] == state["config"]
    )


def test_retention_keeps_last_k_and_every_m(tmp_path):
    run = str(tmp_path / "run")
    Path(checkpoint.step_dir(run, 1)).mkdir(parents=True)  # a leftover save with no DONE
    for s in range(2, 13):
        checkpoint.save(run, _state(s), keep_last=2, keep_every=5)
    assert checkpoint.complete_steps(run) == [5, 10, 11, 12]
    assert not Path(checkpoint.step_dir(run, 1)).exists()
    with pytest.raises(FileNotFoundError, match="no intact checkpoint"):
        checkpoint.load(str(tmp_path / "empty"))


@pytest.mark.gcs
def test_checkpoint_round_trip_on_gcs(gcs_bucket):
    run = f"{gcs_bucket}/run"
    for s in (1, 2):
        checkpoint.save(run, _state(s), keep_last=1)
    assert checkpoint.complete_steps(run) == [2]
    state = checkpoint.load(run)
    assert state["step"] == 2 and torch.equal(state["model"]["w"], torch.full((64,), 2.0))


@pytest.mark.slow
@pytest.mark.gcs
def test_train_and_resume_on_a_gcs_run(gcs_bucket, tmp_path):
    """A gs:// run: shards read through the loader's cache, checkpoints and metrics.jsonl on GCS."""
    from codex.core import fsio

    local = Path(make_run(tmp_path / "local"))
    run = f"{gcs_bucket}/run"
    for f in local.rglob("*"):
        if f.is_file():
            fsio.upload(str(f), f"{run}/{f.relative_to(local)}")
    first = run_train(run, max_steps=2, save_every=1)
    assert first["step"] == 2 and checkpoint.complete_steps(run) == [1, 2]
    second = run_train(run, max_steps=3, save_every=1)  # resumes at 2, one more step
    assert second["step"] == 3
    steps = [
        json.loads(line)["step"] for line in fsio.read_text(f"{run}/metrics.jsonl").splitlines()
    ]
    assert steps == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.gcs
def test_a_gs_run_and_its_resume_print_no_error_gcsfs_handled(gcs_bucket, tmp_path):
    """gcsfs logs the errors it handles itself as warnings, on runs that succeed: every checkpoint
    renames DCP's .metadata.tmp; with the emulator refusing moves (403,
    tests/fixtures/gcs_emulator.py)
    gcsfs's moveTo call fails and it falls back to copy + delete. They stay out of the terminal,
    here on a resumed run; CODEX_DEBUG=1 shows them (proof that they happen)."""
    import os
    import urllib.request

    emulator = os.environ["STORAGE_EMULATOR_HOST"]
    urllib.request.urlopen(f"{emulator}/_moves?refuse=1").read()
    try:
        _gs_run_prints_no_handled_error(gcs_bucket, tmp_path)
    finally:
        urllib.request.urlopen(f"{emulator}/_moves?refuse=0").read()


def _gs_run_prints_no_handled_error(gcs_bucket, tmp_path) -> None:
    from codex.core import fsio

    local = Path(make_run(tmp_path / "local"))

    def train_cli(run: str, steps: int, **env) -> str:
        args = train_cli_args(run, max_steps=steps, save_every=1)
        proc = subprocess.run(
            [sys.executable, "-m", "codex.cli", "train", *args],
            env={**child_env(), **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stderr

    run = f"{gcs_bucket}/run"
    for f in local.rglob("*"):
        if f.is_file():
            fsio.upload(str(f), f"{run}/{f.relative_to(local)}")
    assert "moveTo" in train_cli(run, 1, CODEX_DEBUG="1")  # gcsfs handled an error here...
    err = train_cli(run, 2)  # ...and does again saving step 2 of the resumed run, quietly
    assert "resum" in err.lower()
    assert "Traceback" not in err and "moveTo" not in err and "HttpError" not in err


def test_retention_after_a_fallback_keeps_the_intact_checkpoints(tmp_path, caplog):
    """Newest checkpoints damaged -> resume from an older one -> the next saves must never prune
    the intact steps in favour of the damaged ones still on disk."""
    run = str(tmp_path / "run")
    for s in range(1, 6):
        checkpoint.save(run, _state(s), keep_last=10)
    for s in (4, 5):  # the two newest are damaged
        _shard(run, s).write_bytes(_shard(run, s).read_bytes()[:100])
    assert checkpoint.load(run)["step"] == 3  # the fallback
    checkpoint.save(run, _state(4), keep_last=1)  # training goes on from step 3
    assert checkpoint.complete_steps(run) == [4]
    assert checkpoint.load(run)["step"] == 4 and "not resumed from" in caplog.text
    checkpoint.save(run, _state(5), keep_last=2)
    assert checkpoint.complete_steps(run) == [4, 5] and checkpoint.load(run, 4)["step"] == 4


def test_an_io_error_on_the_newest_checkpoint_is_retried_never_a_fallback(tmp_path, monkeypatch):
    """A storage hiccup is not damage: falling back would let the next save delete the intact
    newer checkpoint. One failed read is retried; a persistent one is an error naming the folder."""
    run = str(tmp_path / "run")
    for s in (1, 2):
        checkpoint.save(run, _state(s), keep_last=5)
    monkeypatch.setattr(checkpoint, "READ_RETRIES", (0.0, 0.0))
    real_damage, calls = checkpoint._damage, []

    def flaky(folder, rank, world, fail_times):
        calls.append(folder)
        if folder.endswith("step_00000002") and len(calls) <= fail_times:
            raise OSError("connection reset")
        return real_damage(folder, rank, world)

    monkeypatch.setattr(checkpoint, "_damage", lambda f, r, w: flaky(f, r, w, 1))
    assert checkpoint.load(run)["step"] == 2  # retried, not the older step 1
    calls.clear()
    monkeypatch.setattr(checkpoint, "_damage", lambda f, r, w: flaky(f, r, w, 99))
    with pytest.raises(OSError, match="step_00000002: could not read the newest checkpoint"):
        checkpoint.load(run)
    assert checkpoint.complete_steps(run) == [1, 2]  # nothing deleted


def test_pinned_staging_works_without_torchs_private_pinning_module(monkeypatch):
    """torch.cuda._pin_memory_utils is private and new (2.8): where a torch has none, staging pins
    through the same CUDA runtime calls (here, without a GPU, they fail as CUDA is absent)."""
    import sys

    import torch.cuda

    from codex.train.checkpoint import dcp

    pin, unpin = dcp._host_pinning()
    assert pin.__module__ == "torch.cuda._pin_memory_utils"  # this torch has it
    monkeypatch.delattr(torch.cuda, "_pin_memory_utils", raising=False)
    monkeypatch.setitem(sys.modules, "torch.cuda._pin_memory_utils", None)
    pin, unpin = dcp._host_pinning()
    assert pin.__module__ == dcp.__name__ and unpin.__module__ == dcp.__name__
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            pin(0, 1)


def test_a_hosts_shards_round_trip_into_any_split(tmp_path):
    """An XLA SPMD tensor is written as its host's pieces (train/checkpoint/xla_shards.py:
    HostShards), each a chunk of the global tensor: one process reads it whole, and pieces of
    another split (another mesh) are filled from the chunks that overlap them. DCP's set-up would
    replace a HostShards target with None in the caller's tree; the planner keeps it."""
    from codex.train.checkpoint.xla_shards import HostShards

    run = str(tmp_path / "run")
    full = torch.arange(40.0).reshape(10, 4)
    written = HostShards(full.shape, full.dtype, {(0, 0): full[:5].clone(), (5, 0): full[5:]})
    checkpoint.save(run, _state(1) | {"model": {"w": written}})
    tree = checkpoint.read_skeleton(checkpoint.step_dir(run, 1))
    assert tree["model"]["w"] == {"__tensor__": [10, 4], "dtype": "float32"}
    assert torch.equal(checkpoint.load(run, 1)["model"]["w"], full)
    split = {(0, 0): torch.empty(3, 4), (3, 0): torch.empty(3, 4), (6, 0): torch.empty(4, 4)}
    target = HostShards(full.shape, full.dtype, split)
    targets = {"model": {"w": target}}
    from codex.train.checkpoint import dcp as dcp_io

    dcp_io.read_tensors(checkpoint.step_dir(run, 1), targets)
    assert targets["model"]["w"] is target
    assert torch.equal(torch.cat([split[(0, 0)], split[(3, 0)], split[(6, 0)]]), full)
    # split on the other dim: a table written sharded on its rows (vocabulary) read into one
    # sharded on its columns (width), as train/xla/sharding.py shards an embedding now
    cols = {(0, 0): torch.empty(10, 2), (0, 2): torch.empty(10, 2)}
    dcp_io.read_tensors(
        checkpoint.step_dir(run, 1), {"model": {"w": HostShards(full.shape, full.dtype, cols)}}
    )
    assert torch.equal(torch.cat([cols[(0, 0)], cols[(0, 2)]], dim=1), full)


def test_a_hosts_shards_stage_for_a_background_save(tmp_path):
    """train.async_save copies what this rank writes into its staging buffer (dcp.py: staged) and
    the writer writes it from there: HostShards pieces too, found by their offsets."""
    from codex.train.checkpoint import dcp as dcp_io
    from codex.train.checkpoint.xla_shards import HostShards
    from codex.train.distributed.control import ControlPlane

    full = torch.arange(24.0).reshape(6, 4)
    pieces = {(0, 0): full[:3].clone(), (3, 0): full[3:].clone()}
    tree = {"model": {"w": HostShards(full.shape, full.dtype, pieces), "b": torch.ones(3)}}
    cache = dcp_io.StagingCache()
    assert dcp_io.staged(tree, cache, ControlPlane())
    pieces[(0, 0)].zero_()  # training goes on: the staged copy is what gets written
    assert cache.plan is not None
    dcp_io.write_staged(str(tmp_path), cache.plan, cache.views, ControlPlane())
    target = {"model": {"w": torch.empty(6, 4), "b": torch.empty(3)}}
    dcp_io.read_tensors(str(tmp_path), target)
    assert torch.equal(target["model"]["w"], full) and torch.equal(
        target["model"]["b"], torch.ones(3)
    )
    assert not dcp_io.staged(tree, cache, ControlPlane())  # same layout: the plan is kept
