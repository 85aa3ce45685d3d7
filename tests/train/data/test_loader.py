"""The rank-strided loader: coverage per epoch, exact resume (also with another world size), val
split coverage, errors, and gs:// streaming through the bounded cache."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from codex.train.data.loader import TrainLoader, val_batches
from codex.train.data.token_shards import load_manifest
from tests.fixtures.loader import T, upload_dir, write_shards  # noqa: F401

# 21 + 12 + 30 + 1 = 64 train, 6 + 5 val windows
SIZES = {
    "train": [170, 97, 8 * 30 + 1, 9],
    "val": [50, 41],
}


def all_windows(d: str, split: str) -> dict[int, int]:
    """first token of each window -> global window id, from the shards themselves."""
    m = load_manifest(d)
    first, wid = {}, 0
    for s in m["shards"]:
        if s["split"] != split:
            continue
        arr = np.load(os.path.join(d, s["path"]))
        for j in range((len(arr) - 1) // T):
            first[int(arr[j * T])] = wid
            wid += 1
    return first


@pytest.fixture
def shards(tmp_path):
    return write_shards(tmp_path / "shards", SIZES)


def ids_of(x: torch.Tensor, first: dict[int, int]) -> list[int]:
    return [first[int(v)] for v in x[:, 0]]


def test_windows_are_cut_per_shard_and_y_is_x_shifted(shards):
    first = all_windows(shards, "train")
    loader = TrainLoader(shards, T, 4, prefetch=0)
    assert loader.windows_per_epoch == len(first) == 64
    x, y = next(loader)
    assert x.shape == y.shape == (4, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    assert torch.equal(y[:, -1], x[:, -1] + 1)  # tokens are a counter within a shard
    assert all(int(v) in first for v in x[:, 0])  # every row starts on a window boundary


@pytest.mark.parametrize("W", [1, 2, 3, 8])
def test_every_window_exactly_once_per_epoch_across_ranks(shards, W):
    first = all_windows(shards, "train")
    n, B = len(first), 3
    loaders = [
        TrainLoader(shards, T, B, rank=r, world_size=W, seed=5, prefetch=0) for r in range(W)
    ]
    steps = -(-2 * n // (B * W))  # two epochs' worth
    stream = {}
    for step in range(steps):
        for r, ld in enumerate(loaders):
            for k, wid in enumerate(ids_of(next(ld)[0], first)):
                stream[step * B * W + r + k * W] = wid
    epoch0 = [stream[p] for p in range(n)]
    epoch1 = [stream[p] for p in range(n, 2 * n)]
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1 and epoch0 != list(range(n))  # shuffled, differently per epoch
    assert loaders[0].state_dict() == loaders[-1].state_dict()  # the state is global


def test_order_depends_on_seed_not_on_world_size(shards):
    first = all_windows(shards, "train")
    a = [ids_of(next(TrainLoader(shards, T, 6, seed=1, prefetch=0))[0], first)]
    b = [ids_of(next(TrainLoader(shards, T, 6, seed=2, prefetch=0))[0], first)]
    assert a != b


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_at_any_step_reproduces_the_next_100_batches(shards, prefetch):
    ref = TrainLoader(shards, T, 5, rank=1, world_size=2, seed=3, prefetch=prefetch)
    batches, states = [], []
    for _ in range(160):
        states.append(ref.state_dict())  # must describe what was consumed, not what was read ahead
        batches.append(next(ref))
    ref.close()
    for step in (0, 1, 6, 7, 13, 37, 59):
        ld = TrainLoader(shards, T, 5, rank=1, world_size=2, seed=3, prefetch=prefetch)
        # survives a JSON / checkpoint round trip
        ld.load_state_dict(json.loads(json.dumps(states[step])))
        for i in range(100):
            x, y = next(ld)
            assert torch.equal(x, batches[step + i][0]) and torch.equal(y, batches[step + i][1]), (
                step,
                i,
            )
        ld.close()


def test_state_dict_is_what_the_consumer_received_despite_read_ahead(shards):
    ld = TrainLoader(shards, T, 4, seed=0, prefetch=4)
    next(ld)
    import time

    time.sleep(0.2)  # let the thread fill its queue
    assert ld.state_dict()["position"] == 4 and ld.state_dict()["epoch"] == 0
    ld.close()


def test_resume_with_a_different_world_size_continues_the_global_sequence(shards):
    first = all_windows(shards, "train")

    def global_stream(W, B, steps, state=None):
        loaders = [
            TrainLoader(shards, T, B, rank=r, world_size=W, seed=9, prefetch=1) for r in range(W)
        ]
        if state:
            for ld in loaders:
                ld.load_state_dict(state)
        out = {}
        for step in range(steps):
            for r, ld in enumerate(loaders):
                for k, wid in enumerate(ids_of(next(ld)[0], first)):
                    out[step * B * W + r + k * W] = wid
        st = loaders[0].state_dict()
        for ld in loaders:
            ld.close()
        return [out[p] for p in sorted(out)], st

    reference, _ = global_stream(1, 4, 60)  # 240 windows, crossing epochs
    head, state = global_stream(2, 4, 5)  # 40 windows on 2 ranks
    tail, _ = global_stream(4, 2, 20, state)  # then 160 more on 4 ranks, B=2
    tail2, _ = global_stream(3, 2, 10, {"epoch": 1, "position": 13})
    assert head + tail == reference[:200]
    assert tail2 == reference[len(first) + 13 : len(first) + 13 + 60]


def test_state_from_another_dataset_or_seq_len_is_refused(shards):
    st = TrainLoader(shards, T, 4, seed=1, prefetch=0).state_dict()
    with pytest.raises(ValueError, match="seed"):
        TrainLoader(shards, T, 4, seed=2, prefetch=0).load_state_dict(st)
    with pytest.raises(ValueError, match="seq_len"):
        TrainLoader(shards, T + 1, 4, seed=1, prefetch=0).load_state_dict(st)
    with pytest.raises(ValueError, match="position"):
        TrainLoader(shards, T, 4, seed=1, prefetch=0).load_state_dict(
            {"epoch": 0, "position": 10**6}
        )


def test_block_shuffle_covers_every_window_and_stays_within_blocks(tmp_path):
    d = write_shards(tmp_path / "s", {"train": [8 * 10 + 1] * 6, "val": [20]})
    first = all_windows(d, "train")
    ld = TrainLoader(d, T, 5, seed=4, prefetch=0, shuffle_shards=2)
    seq = [w for _ in range(12) for w in ids_of(next(ld)[0], first)]  # 60 windows = one epoch
    assert sorted(seq) == list(range(60))
    for b in range(3):  # each block of 20 windows comes from exactly 2 shards
        assert len({w // 10 for w in seq[b * 20 : (b + 1) * 20]}) == 2
    with pytest.raises(ValueError, match="shuffle_shards"):
        TrainLoader(d, T, 5, seed=4, prefetch=0).load_state_dict(ld.state_dict())


@pytest.mark.parametrize("W", [1, 2, 3])
def test_val_covers_every_window_once_in_fixed_order(shards, W):
    first = all_windows(shards, "val")
    n, B = len(first), 4
    seen, masked_seen, counts = [], [], []
    for r in range(W):
        # several ranks: masked, equal-count batches whatever with_mask says (one process: (x, y))
        batches = list(val_batches(shards, T, B, rank=r, world_size=W))
        assert all(len(b) == (2 if W == 1 else 3) for b in batches)
        seen += [w for b in batches for w in ids_of(b[0] if W == 1 else b[0][b[2]], first)]
        mb = list(val_batches(shards, T, B, rank=r, world_size=W, with_mask=True))
        counts.append(len(mb))
        for x, _y, mask in mb:
            assert x.shape == (B, T) and mask.dtype == torch.bool
            masked_seen += [w for w, ok in zip(ids_of(x, first), mask.tolist(), strict=True) if ok]
    assert sorted(seen) == list(range(n)) == sorted(masked_seen)
    assert len(set(counts)) == 1  # same number of batches on every rank with a mask
    rank0 = [w for x, _ in val_batches(shards, T, B) for w in ids_of(x, first)]
    assert rank0 == list(range(n))  # fixed order
    limited = [w for x, _ in val_batches(shards, T, B, max_tokens=3 * T) for w in ids_of(x, first)]
    assert limited == [0, 1, 2]


def test_bad_inputs_name_the_problem(tmp_path, shards):
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        TrainLoader(str(tmp_path / "nothing"), T, 2)
    with pytest.raises(ValueError, match="no window"):
        TrainLoader(shards, 10_000, 2)
    m = json.load(open(os.path.join(shards, "manifest.json")))
    m["shards"][0]["tokens"] += 1
    json.dump(m, open(os.path.join(shards, "manifest.json"), "w"))
    with pytest.raises(ValueError, match="train_00000.npy"):
        next(TrainLoader(shards, T, 64, prefetch=0))
    # errors in the thread reach the consumer
    with pytest.raises(ValueError, match="train_00000.npy"):
        next(TrainLoader(shards, T, 64, prefetch=2))


@pytest.mark.gcs
def test_gs_shards_stream_through_a_bounded_cache(tmp_path, gcs_bucket):
    local = write_shards(tmp_path / "local", {"train": [8 * 10 + 1] * 6, "val": [30]})
    remote = f"{gcs_bucket}/run/shards"
    upload_dir(local, remote)
    cache = tmp_path / "cache"
    ref = TrainLoader(local, T, 5, seed=2, prefetch=0, shuffle_shards=2)
    ld = TrainLoader(remote, T, 5, seed=2, prefetch=2, shuffle_shards=2, cache_dir=str(cache))
    for _ in range(30):  # 2.5 epochs
        a, b = next(ref), next(ld)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        # about 2 blocks of 2 shards: the cap (4) holds between evictions, and the next block
        # fetched ahead can stand beside both for a moment (3 blocks); a download in flight
        # (".part-*") is no shard yet
        assert (
            len([f for f in os.listdir(cache) if f.endswith(".npy") and not f.startswith(".")]) <= 6
        )
    ld.close()
    val_local = [x for x, _ in val_batches(local, T, 2)]
    val_remote = [x for x, _ in val_batches(remote, T, 2, cache_dir=str(tmp_path / "vcache"))]
    assert len(val_local) == 2 and all(
        torch.equal(a, b) for a, b in zip(val_local, val_remote, strict=False)
    )


@pytest.mark.gcs
def test_gs_shard_with_a_wrong_checksum_is_an_error(tmp_path, gcs_bucket):
    local = write_shards(tmp_path / "local", {"train": [8 * 10 + 1] * 2})
    m = json.load(open(os.path.join(local, "manifest.json")))
    m["shards"][1]["sha256"] = "0" * 64
    json.dump(m, open(os.path.join(local, "manifest.json"), "w"))
    remote = f"{gcs_bucket}/shards"
    upload_dir(local, remote)
    ld = TrainLoader(remote, T, 20, prefetch=0, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="sha256"):
        next(ld)


def test_parquet_entries_of_format_both_are_skipped(tmp_path):
    import json

    d = write_shards(tmp_path / "s", {"train": [8 * 10 + 1] * 2, "val": [30]})
    mpath = os.path.join(d, "manifest.json")
    m = json.load(open(mpath))
    npy_only = TrainLoader(d, T, 5, seed=1, prefetch=0)
    expect = [next(npy_only) for _ in range(3)]
    m["shards"] += [
        dict(s, path=s["path"].replace(".npy", ".parquet"), format="parquet") for s in m["shards"]
    ]
    json.dump(m, open(mpath, "w"))
    both = TrainLoader(d, T, 5, seed=1, prefetch=0)
    for a in expect:
        b = next(both)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_host_cache_never_evicts_a_shard_another_holder_holds(tmp_path):
    # Two caches on one folder behave like two processes: flock locks belong to open files.
    from codex.core.fsio import file_sha256 as sha256_of
    from codex.train.data.shard_cache import HostShardCache

    src = write_shards(tmp_path / "src", {"train": [8 * 4 + 1] * 3})
    paths = [os.path.join(src, f"train_{i:05d}.npy") for i in range(3)]
    shas = [sha256_of(p) for p in paths]
    folder = str(tmp_path / "cache")
    a, b = (HostShardCache(folder, "train", paths, shas, bound=1) for _ in range(2))
    on_disk = lambda: sorted(f for f in os.listdir(folder) if f.startswith("train_"))  # noqa: E731
    a.acquire(0), a.acquire(1)
    b.acquire(1), b.acquire(2)
    b.evict()
    # shard 1 was on disk already: one download per host
    assert a.fetched == [0, 1] and b.fetched == [2]
    assert len(on_disk()) == 3  # over the bound of 1, but every file is held
    a.release(0)
    a.release(1)
    b.evict()
    assert on_disk() == [b.name(1), b.name(2)]  # only the file nobody held went
    b.close()
    os.utime(a.path(2), (10**9, 10**9))  # shard 2 last used long ago (not left to mtime resolution)
    a.evict()
    assert on_disk() == [a.name(1)]  # least recently used first
    assert np.array_equal(np.load(a.path(1)), np.load(paths[1]))
    bad = HostShardCache(str(tmp_path / "c2"), "train", paths, ["0" * 64] * 3, bound=1)
    with pytest.raises(ValueError, match="train_00000.npy: sha256 does not match"):
        bad.acquire(0)
    assert os.listdir(str(tmp_path / "c2")) == ["locks"]  # nothing unverified left behind


def test_host_cache_waiter_is_not_blocked_by_the_downloader_holding_the_shard(
    tmp_path, monkeypatch
):
    # Two ranks find a shard missing at the same moment; the one that downloads it keeps holding it
    # (as a rank does until its next block). The other must then get the file, not wait for that
    # hold to end: ranks wait for each other in the step's collective, so that wait would hang the
    # job.
    import threading

    from codex.core.fsio import file_sha256 as sha256_of
    from codex.train.data.shard_cache import HostShardCache

    src = write_shards(tmp_path / "src", {"train": [8 * 4 + 1]})
    paths = [os.path.join(src, "train_00000.npy")]
    folder = str(tmp_path / "cache")
    a, b = (
        HostShardCache(folder, "train", paths, [sha256_of(paths[0])], bound=1) for _ in range(2)
    )
    both_looked, real_exists, first_look = threading.Barrier(2, timeout=10), os.path.exists, set()

    def exists(path):  # each acquirer's first look at the file waits for the other's
        seen = real_exists(path)
        if path == a.path(0) and threading.get_ident() not in first_look:
            first_look.add(threading.get_ident())
            both_looked.wait()
        return seen

    monkeypatch.setattr(os.path, "exists", exists)
    threads = [threading.Thread(target=c.acquire, args=(0,), daemon=True) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "one holder waits for the other's hold to end"
    assert a.holds(0) and b.holds(0) and sorted(a.fetched + b.fetched) == [0]  # one download
    a.close()
    b.close()
