"""The mixture loader (train.data.mixture): shares follow the weights within 1% over 1,000 steps,
the global batch is the same for any world size, a resume from the saved state gives bitwise the
same batches, a source that runs out starts its next epoch reshuffled (one log line), a schedule
changes the weights at its step, and bad names or states are refused naming them."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from codex.core.config import ConfigError, build_config
from codex.train.checkpoint import folders as checkpoint
from codex.train.data.loader import TrainLoader
from codex.train.data.mixture import Mixture, MixtureLoader, assign, check_sources
from codex.train.data.token_shards import load_manifest
from tests.fixtures.bad_input import invoke
from tests.fixtures.loader import T, write_source_shards
from tests.fixtures.runs import (  # noqa: F401
    KILL_AT_SAVE,
    child_env,
    make_run,
    one_thread,
    run_train,
    train_cli_args,
)

ROOT = Path(__file__).resolve().parents[3]

# web: 50 + 30 = 80 train windows, code: 20 (it runs out first)
SOURCES = {
    "web": {"train": [8 * 50 + 1, 8 * 30 + 1], "val": [50]},
    "code": {"train": [8 * 20 + 1], "val": [41]},
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_source_shards(tmp_path_factory.mktemp("mix") / "shards", SOURCES)


def loader(shards, weights=None, B=4, **kw) -> MixtureLoader:
    kw.setdefault("prefetch", 0)
    mixture = kw.pop("mixture", None) or Mixture(weights or {"web": 0.7, "code": 0.3})
    return MixtureLoader(shards, T, B, mixture, **kw)


def source_of(x: torch.Tensor) -> np.ndarray:
    """0 = web, 1 = code: write_source_shards counts source i's tokens from 10000 * i."""
    return x[:, 0].numpy() // 10000


def test_shares_follow_the_weights_within_one_percent_over_1000_steps(shards):
    drawn = np.zeros(2)
    ld = loader(shards, seed=5)
    for _ in range(1000):
        x, _ = next(ld)
        drawn += np.bincount(source_of(x), minlength=2) * T  # tokens
    shares = drawn / drawn.sum()
    assert abs(shares[0] - 0.7) < 0.01 and abs(shares[1] - 0.3) < 0.01, shares
    # smooth round robin: every prefix is within a sequence per source of its share
    credits, counts = [0, 0], np.zeros(2)
    for g in range(1, 2001):
        counts[assign(credits, (7, 3))] += 1
        assert np.all(np.abs(counts - g * np.array([0.7, 0.3])) < 1)


@pytest.mark.parametrize("W", [2, 3])
def test_the_global_batch_is_the_same_for_any_world_size(shards, W):
    one = loader(shards, B=4 * W)
    ranks = [loader(shards, rank=r, world_size=W) for r in range(W)]
    for _ in range(12):
        x = next(one)[0]
        parts = [next(r)[0] for r in ranks]
        for r in range(W):  # rank r holds the global positions r, r + W, ...
            assert torch.equal(parts[r], x[r::W])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_from_the_saved_state_gives_bitwise_the_same_batches(shards, prefetch):
    ref = loader(shards, prefetch=prefetch, seed=9)
    want = [next(ref) for _ in range(40)]
    first = loader(shards, prefetch=prefetch, seed=9)
    for _ in range(17):  # past code's first epoch (20 windows at 1.2 a batch)
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint's state.json holds it
    first.close()
    assert state["mixture"]["sources"]["code"]["epoch"] == 1
    resumed = loader(shards, prefetch=prefetch, seed=9)
    resumed.load_state_dict(state)
    for x, y in want[17:]:
        got = next(resumed)
        assert torch.equal(got[0], x) and torch.equal(got[1], y)
    resumed.close()
    ref.close()


def test_an_exhausted_source_starts_its_next_epoch_reshuffled(shards, caplog):
    ld = loader(shards, {"web": 0.5, "code": 0.5}, B=5)
    with caplog.at_level(logging.INFO, logger="codex.train"):
        rows = torch.cat([next(ld)[0] for _ in range(16)])  # 40 code draws: 2 epochs of 20
    code = rows[source_of(rows) == 1][:, 0].tolist()
    assert len(code) == 40
    epochs = code[:20], code[20:]
    assert sorted(epochs[0]) == sorted(epochs[1]) and len(set(epochs[0])) == 20  # each once
    assert epochs[0] != epochs[1]  # reshuffled
    said = [r.getMessage() for r in caplog.records if "'code'" in r.getMessage()]
    assert said == [
        "loader: source 'code' has given all its 20 windows: its epoch 1 starts, reshuffled"
    ]


def test_a_schedule_changes_the_weights_at_its_step(shards):
    mixture = Mixture({"web": 1.0, "code": 0.0}, [(5, {"web": 0.0, "code": 1.0})], 8)
    ld = loader(shards, mixture=mixture, B=4, world_size=2)  # 8 positions a step: one batch
    srcs = [set(source_of(next(ld)[0]).tolist()) for _ in range(8)]
    assert srcs == [{0}] * 5 + [{1}] * 3


def test_a_source_left_out_is_never_drawn(shards):
    ld = loader(shards, {"web": 1.0})
    assert all(set(source_of(next(ld)[0]).tolist()) == {0} for _ in range(30))


def test_unknown_sources_and_bad_weights_exit_2_naming_the_key(shards):
    cfg = build_config(overrides=["train.data.mixture=web:0.7,books:0.3"])
    with pytest.raises(ConfigError, match=r"train.data.mixture: no source 'books'.*web, code"):
        check_sources(cfg.train.data, load_manifest(shards), shards)
    for bad, said in (
        ("train.data.mixture=web:-1", "train.data.mixture.web: the weight must be a number >= 0"),
        ("train.data.mixture=web:0", "train.data.mixture: the weights add up to 0"),
        ("train.data.mixture=web", "train.data.mixture: expected NAME:VALUE"),
    ):
        with pytest.raises(ConfigError, match=said):
            build_config(overrides=[bad])


def test_states_of_the_other_kind_are_refused(shards):
    plain = TrainLoader(shards, T, 4, prefetch=0)
    mix = loader(shards)
    with pytest.raises(ValueError, match="saved without train.data.mixture"):
        mix.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="saved by a run with train.data.mixture"):
        plain.load_state_dict(mix.state_dict())
    state = mix.state_dict()
    state["mixture"]["sources"]["code"]["windows"] = 21
    with pytest.raises(ValueError, match="source 'code' had 21 windows, now 20"):
        loader(shards).load_state_dict(state)


def tag_sources(run: str) -> None:
    """make_run's train shards as two sources (web, code); its val shard is web's."""
    path = Path(run) / "shards" / "manifest.json"
    m = json.loads(path.read_text())
    for e in m["shards"]:
        e["source"] = "code" if e["path"] == "train_00001.npy" else "web"
    path.write_text(json.dumps(m))


@pytest.mark.slow
def test_codex_train_killed_and_resumed_draws_the_same_mixture(tmp_path):
    steps = {"max_steps": 6, "save_every": 2, "data.mixture": "web:0.7,code:0.3"}
    ref_run, run = make_run(tmp_path / "ref"), make_run(tmp_path / "killed")
    for r in (ref_run, run):
        tag_sources(r)
    run_train(ref_run, **steps)
    script = KILL_AT_SAVE.format(kill_step=4, args=train_cli_args(run, **steps))
    proc = subprocess.run(
        [sys.executable, "-c", script], env=child_env(), cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert checkpoint.latest_step(run) == 2
    run_train(run, **steps)
    a, b = checkpoint.load(ref_run), checkpoint.load(run)
    assert a["loader"] == b["loader"]
    assert a["loader"]["mixture"]["sources"]["code"]["drawn"] == 7  # 6 steps x 4 rows x 0.3
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_codex_train_with_an_unknown_source_exits_2_naming_the_sources(tmp_path):
    run = make_run(tmp_path / "run")
    tag_sources(run)
    args = train_cli_args(run, **{"data.mixture": "web:0.5,books:0.5"})
    invoke(["train", *args], 2, "train.data.mixture: no source 'books'", "(its sources: web, code)")
    assert not (Path(run) / "checkpoints" / "step_00000001").exists()


def test_a_resume_on_another_world_size_goes_on_with_the_same_global_stream(shards):
    ranks = [loader(shards, rank=r, world_size=2) for r in range(2)]
    for _ in range(7):
        for r in ranks:
            next(r)
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()  # the state is global
    one = loader(shards, B=8)
    one.load_state_dict(state)
    for _ in range(5):
        x = next(one)[0]
        parts = [next(r)[0] for r in ranks]
        assert torch.equal(x[0::2], parts[0]) and torch.equal(x[1::2], parts[1])
