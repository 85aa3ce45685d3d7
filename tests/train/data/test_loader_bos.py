"""train.bos_aligned: training windows moved to a document start (<|bos|>) inside their grid cell
where they still fit; the same window ids, the same order, the same exact resume."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch

from codex.train.data.loader import TrainLoader
from codex.train.data.token_shards import bos_aligned_starts

T = 8


def test_each_window_starts_at_the_first_bos_of_its_cell_that_fits():
    arr = np.arange(100, 150, dtype=np.uint16)  # 50 tokens: (50 - 1) // 8 = 6 windows
    arr[[3, 9, 20, 21, 44]] = 0
    # cells [0,8) [8,16) [16,24) [24,32) [32,40) [40,48): BOS at 3, 9, 20 (first of 20/21); none in
    # the 4th and 5th cells; the BOS at 44 leaves 6 tokens, fewer than T + 1, so the 6th stays put.
    assert bos_aligned_starts(arr, 6, T, bos=0).tolist() == [3, 9, 20, 24, 32, 40]
    # no BOS at all
    assert bos_aligned_starts(arr + 1, 6, T, bos=0).tolist() == [
        0,
        8,
        16,
        24,
        32,
        40,
    ]


def write_docs(
    root, docs_per_shard: list[list[int]], seed: int = 0
) -> tuple[str, list[np.ndarray]]:
    """Shards of documents (<|bos|> = 0, then tokens >= 3) of the given lengths, and a manifest."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    entries, arrays = [], []
    for i, lengths in enumerate(docs_per_shard):
        arr = np.concatenate(
            [np.concatenate([[0], rng.integers(3, 5000, n - 1)]) for n in lengths]
        ).astype(np.uint16)
        name = f"train_{i:05d}.npy"
        np.save(os.path.join(root, name), arr)
        digest = hashlib.sha256(open(os.path.join(root, name), "rb").read()).hexdigest()
        entries.append(
            {
                "split": "train",
                "path": name,
                "format": "npy",
                "tokens": len(arr),
                "documents": len(lengths),
                "sha256": digest,
            }
        )
        arrays.append(arr)
    manifest = {
        "format_version": 1,
        "tokenizer": {"sha256": "x", "vocab_size": 5000},
        "special_ids": {"bos": 0, "eos": 1, "pad": 2},
        "dtype": "uint16",
        "append_eos": False,
        "val_fraction": 0.1,
        "shards": entries,
        "totals": {},
    }
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return str(root), arrays


@pytest.fixture
def docs(tmp_path):
    return write_docs(tmp_path / "shards", [[5, 30, 3, 12, 40, 7], [9, 9, 9, 60]])


def test_an_epoch_gives_every_window_once_from_its_aligned_start(docs):
    shards_dir, arrays = docs
    expected = []  # every window of the split, as it must come out of the loader
    for arr in arrays:
        n_win = (len(arr) - 1) // T
        expected += [
            arr[s : s + T + 1].astype(np.int64).tolist()
            for s in bos_aligned_starts(arr, n_win, T, 0)
        ]
    ld = TrainLoader(shards_dir, T, 3, seed=5, prefetch=0, bos_aligned=True)
    plain = TrainLoader(shards_dir, T, 3, seed=5, prefetch=0)
    assert ld.windows_per_epoch == plain.windows_per_epoch == len(expected)
    got = []
    while len(got) < len(expected):
        x, y = next(ld)
        assert torch.equal(x[:, 1:], y[:, :-1])
        got += [row_x + [row_y[-1]] for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True)]
    assert sorted(got[: len(expected)]) == sorted(expected)
    grid_at_bos = sum(int(arr[j * T]) == 0 for arr in arrays for j in range((len(arr) - 1) // T))
    assert (
        sum(w[0] == 0 for w in got[: len(expected)])
        == sum(w[0] == 0 for w in expected)
        > grid_at_bos
    )


def test_aligned_resume_is_exact_and_a_changed_setting_is_refused(docs):
    shards_dir, _ = docs
    ref = TrainLoader(shards_dir, T, 2, rank=1, world_size=2, seed=3, prefetch=2, bos_aligned=True)
    states, batches = [], []
    for _ in range(30):
        states.append(ref.state_dict())
        batches.append(next(ref))
    ref.close()
    ld = TrainLoader(shards_dir, T, 2, rank=1, world_size=2, seed=3, prefetch=2, bos_aligned=True)
    ld.load_state_dict(json.loads(json.dumps(states[11])))
    for i in range(11, 30):
        x, y = next(ld)
        assert torch.equal(x, batches[i][0]) and torch.equal(y, batches[i][1]), i
    ld.close()
    with pytest.raises(ValueError, match="bos_aligned"):
        TrainLoader(shards_dir, T, 2, rank=1, world_size=2, seed=3).load_state_dict(states[11])
