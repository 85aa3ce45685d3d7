"""codex data shard's encode units: a part cut into row ranges when the parts are fewer than the
workers can take (issue 27), the row-range reader, and resuming a run whose parts were cut."""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codex.core import fsio
from codex.core.config import Config
from codex.pipeline import executor
from codex.pipeline.executor import Where, policy
from codex.pipeline.readers import parquet as parquet_mod
from codex.pipeline.shard import corpus as corpus_mod
from codex.pipeline.shard import encode as encode_mod
from codex.pipeline.shard import manifest as manifest_mod
from codex.pipeline.shard import scan as scan_mod
from codex.pipeline.shard import shard as shard_mod
from codex.pipeline.shard import write as write_mod
from codex.pipeline.shard.corpus import read_text_rows
from codex.pipeline.shard.errors import ShardDataError
from codex.pipeline.shard.shard import run_shard
from codex.pipeline.shard.verify import verify_shards
from codex.pipeline.tokenizer import tokenizer as tokenizer_mod
from tests.fixtures.shard import Stopped, make_cfg, make_docs, make_run, npy_sha, reference_shards

GROUP = 30  # rows per row group of the test parts: cuts every 8 rows fall inside them


def write_part(path: Path, texts: list, group: int = GROUP) -> None:
    pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), path, group)


def texts_of(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {i} " + "é東 word " * rng.randint(0, 40) for i in range(n)]


# --- the row-range reader ------------------------------------------------------------------------


def spy_on_decoding(monkeypatch) -> list[tuple[str, list[int]]]:
    """What parquet_text_rows decodes: ("whole", [group]) read_row_group, ("stream", groups)
    iter_batches."""
    decoded: list[tuple[str, list[int]]] = []
    read_row_group, iter_batches = pq.ParquetFile.read_row_group, pq.ParquetFile.iter_batches

    def whole(self, i, *args, **kwargs):
        decoded.append(("whole", [i]))
        return read_row_group(self, i, *args, **kwargs)

    def stream(self, *args, **kwargs):
        decoded.append(("stream", list(kwargs["row_groups"])))
        return iter_batches(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", whole)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", stream)
    return decoded


@pytest.mark.parametrize("cached", [True, False])
def test_a_row_range_reads_exactly_its_rows(tmp_path, monkeypatch, cached):
    """Decoded whole and kept (groups up to ROW_GROUP_CACHE_BYTES) or streamed: only the row groups
    that hold the range are read, and exactly its rows come out."""
    if not cached:
        monkeypatch.setattr(parquet_mod, "ROW_GROUP_CACHE_BYTES", 0)
    texts = texts_of(100)
    path = tmp_path / "part.parquet"
    write_part(path, texts)  # row groups of 30, 30, 30, 10 rows
    monkeypatch.setattr(corpus_mod, "READ_ROWS", 7)  # batches that straddle the cuts
    decoded = spy_on_decoding(monkeypatch)
    how = "whole" if cached else "stream"
    whole = [t for batch in read_text_rows(str(path), 0, 100) for t in batch]
    assert whole == pq.read_table(path).column("text").to_pylist() == texts
    for a, b, groups in [
        (0, 30, [0]),
        (30, 60, [1]),
        (5, 25, [0]),  # inside one row group
        (25, 65, [0, 1, 2]),  # from the middle of one to the middle of the third
        (29, 31, [0, 1]),
        (59, 100, [1, 2, 3]),
        (95, 100, [3]),
        (0, 1, [0]),
        (99, 100, [3]),
    ]:
        parquet_mod._last_group.clear()
        decoded.clear()
        got = [t for batch in read_text_rows(str(path), a, b) for t in batch]
        assert got == texts[a:b], (a, b)
        assert decoded == [(how, [g]) for g in groups], (a, b)
        assert all(len(batch) <= 7 for batch in read_text_rows(str(path), a, b))
    decoded.clear()
    assert list(read_text_rows(str(path), 40, 40)) == [] and decoded == []
    assert bool(parquet_mod._last_group) == cached


def test_consecutive_ranges_decode_a_row_group_once(tmp_path, monkeypatch):
    """Ranges taken in order, as an encode process takes its units, decode each row group once,
    unless the file was rewritten in between (its footer differs) or another file was read."""
    texts = texts_of(100)
    path = tmp_path / "part.parquet"
    write_part(path, texts)
    decoded = spy_on_decoding(monkeypatch)
    parquet_mod._last_group.clear()
    got = []
    for a in range(0, 100, 8):
        got += [t for batch in read_text_rows(str(path), a, min(a + 8, 100)) for t in batch]
    assert got == texts
    assert decoded == [("whole", [g]) for g in range(4)]
    decoded.clear()
    assert sum(map(len, read_text_rows(str(path), 91, 95))) == 4 and decoded == []
    other = tmp_path / "other.parquet"
    write_part(other, texts_of(40, seed=2))
    assert sum(map(len, read_text_rows(str(other), 31, 33))) == 2
    assert decoded == [("whole", [1])]
    write_part(path, texts_of(100, seed=1))  # the same name, other texts
    decoded.clear()
    assert next(read_text_rows(str(path), 0, 1)) == texts_of(100, seed=1)[:1]
    assert next(read_text_rows(str(path), 1, 2)) == texts_of(100, seed=1)[1:2]
    assert decoded == [("whole", [0])]


def test_a_null_text_is_named_by_its_row_only_in_the_ranges_that_hold_it(tmp_path):
    texts: list = texts_of(100)
    texts[45] = None
    path = tmp_path / "part.parquet"
    write_part(path, texts)
    assert sum(map(len, read_text_rows(str(path), 0, 45))) == 45
    assert sum(map(len, read_text_rows(str(path), 46, 100))) == 54
    with pytest.raises(ShardDataError, match=r"part\.parquet: row 45: text is null"):
        list(read_text_rows(str(path), 40, 50))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ShardDataError, match="bad.parquet: not a readable parquet file"):
        list(read_text_rows(str(tmp_path / "bad.parquet"), 0, 10))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    with pytest.raises(ShardDataError, match="no 'text' column"):
        list(read_text_rows(str(tmp_path / "nocol.parquet"), 0, 1))


# --- where the parts are cut ----------------------------------------------------------------------


def scans_of(tmp_path: Path, sizes: list[int], val_fraction: float = 0.3) -> list[dict]:
    scans = []
    for k, n in enumerate(sizes):
        path = tmp_path / f"part-{k}.parquet"
        # skewed documents: the first rows of each part are 20x bigger than the rest
        write_part(path, [("x " * (400 if i < n // 4 else 20)) + str(i) for i in range(n)])
        scans.append(scan_mod.shard_scan_unit(scan_mod._ScanUnit(str(path), val_fraction)))
    return scans


def test_cuts_keep_whole_parts_when_there_are_enough(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_mod, "BLOCK_ROWS", 4)
    scans = scans_of(tmp_path, [100] * 8)
    whole = [[0, 100]] * 8
    assert encode_mod._cuts(scans, 1) == whole  # nothing runs side by side
    assert encode_mod._cuts(scans, 2) == whole  # 8 parts >= 4 units x 2 workers
    assert len(sum((c[1:] for c in encode_mod._cuts(scans, 3)), [])) >= 12


def test_cuts_balance_bytes_at_the_sampled_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_mod, "BLOCK_ROWS", 4)
    (scan,) = scans_of(tmp_path, [803])
    assert scan["rows_at"].tolist() == [*range(0, 803, 4), 803]
    assert scan["bytes_at"][-1] == sum(
        len(t.encode()) for t in pq.read_table(tmp_path / "part-0.parquet").column(0).to_pylist()
    )
    (cut,) = encode_mod._cuts([scan], 2)
    assert cut[0] == 0 and cut[-1] == 803 and cut == sorted(set(cut))
    assert all(r % 4 == 0 for r in cut[:-1])
    # 8 units, the last 2 of them cut in pieces that halve: the two workers run out of work
    # together
    body = encode_mod.UNITS_PER_WORKER * 2 - 2
    assert encode_mod.TAIL_HALVINGS == 3
    assert len(cut) - 1 == body + 2 * 4
    at = dict(zip(scan["rows_at"].tolist(), scan["bytes_at"].tolist(), strict=True))
    sizes = [at[b] - at[a] for a, b in zip(cut, cut[1:], strict=False)]
    # about equal bytes (within a block of the big documents), not equal rows; the tail's pieces
    # halving, the first two within a block of the big documents, the rest (small documents, 45
    # bytes) within a block of those
    unit = scan["bytes_at"][-1] / 8
    assert all(abs(x - unit) <= 4 * 810 for x in sizes[:body]), sizes
    tail = [unit / 2, unit / 2, unit / 4, unit / 4] + [unit / 8] * 4
    slack = [4 * 810] * 2 + [4 * 45] * 6
    assert all(abs(x - y) <= d for x, y, d in zip(sizes[body:], tail, slack, strict=True)), (
        sizes[body:],
        tail,
    )
    assert cut[1] < 803 // 8


def test_cuts_of_several_parts_follow_the_corpus_bytes(tmp_path, monkeypatch):
    """Parts of unequal size: each is cut where the corpus's unit ends fall in it, so a small
    part stays whole and the tail's small units are in the last part."""
    monkeypatch.setattr(scan_mod, "BLOCK_ROWS", 4)
    scans = scans_of(tmp_path, [40, 800, 800])
    cuts = encode_mod._cuts(scans, 2)
    assert cuts[0] == [0, 40]
    n_units = sum(len(c) - 1 for c in cuts)
    assert encode_mod.UNITS_PER_WORKER * 2 <= n_units <= 6 + 2 * (encode_mod.TAIL_HALVINGS + 1) + 2
    at = dict(zip(scans[2]["rows_at"].tolist(), scans[2]["bytes_at"].tolist(), strict=True))
    last = [at[b] - at[a] for a, b in zip(cuts[2], cuts[2][1:], strict=False)]
    assert last[-1] < last[0] / 2, (cuts, last)  # in bytes: the tail's units are small


def test_a_part_scanned_in_row_ranges_on_several_workers_is_scanned_as_a_whole(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(scan_mod, "BLOCK_ROWS", 4)
    (whole,) = scans_of(tmp_path, [203])  # row groups of 30 rows: ranges end off the 4-row grid
    path = str(tmp_path / "part-0.parquet")
    for side_by_side in (2, 3, 7):
        units = scan_mod._scan_units([path], 0.3, encode_mod.UNITS_PER_WORKER * side_by_side)
        # byte-balanced at row groups: the big documents' groups are fewer rows each
        # UNITS_PER_WORKER ranges a worker, as the row groups allow (7 of them here): the driver
        # scans from the front while a pool process starts, and each joins for what is left
        assert min(side_by_side + 1, 7) <= len(units) <= 7
        assert units[0].start == 0 and units[-1].stop == 203
        assert all(u.start % GROUP == 0 for u in units)  # cut at row groups
        joined = scan_mod._joined_scans(
            [(u.start, scan_mod.shard_scan_unit(u)) for u in reversed(units)]
        )
        assert joined.keys() == whole.keys()
        for key, value in whole.items():
            same = (
                np.array_equal(joined[key], value) if key.endswith("_at") else joined[key] == value
            )
            assert same, key
    # one unit a part when there are enough parts (UNITS_PER_WORKER a worker), and for an empty
    # part
    empty = tmp_path / "empty.parquet"
    write_part(empty, [])
    many = [path, str(empty)] * encode_mod.UNITS_PER_WORKER
    assert [(u.start, u.stop) for u in scan_mod._scan_units(many, 0.3, 8)] == [(0, -1)] * len(many)
    units = scan_mod._scan_units([path, str(empty)], 0.3, 8)
    assert len(units) > 2 and (units[-1].path, units[-1].start, units[-1].stop) == (
        str(empty),
        0,
        -1,
    )
    assert [(u.start, u.stop) for u in scan_mod._scan_units([str(empty)], 0.3, 8)] == [(0, -1)]
    # a damaged part is named (the driver reads its footer to cut it)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(path_bytes := Path(path).read_bytes()[:-100])
    assert path_bytes
    with pytest.raises(ShardDataError, match=f"{bad}: not a readable parquet file"):
        scan_mod._scan_units([str(bad)], 0.3, 8)


def in_flight_together(n: int):
    """A fake request that returns only once n calls are in flight at once: called one after
    another, the first waits for the others and fails (BrokenBarrierError)."""
    barrier = threading.Barrier(n, timeout=20)

    def wait() -> None:
        barrier.wait()

    return wait


def test_the_driver_asks_about_every_part_side_by_side(monkeypatch):
    """A part's size (shard's plan, tokenize's rerun check) and parquet footer (to cut parts into
    row ranges) are a request each on an object store: the driver sends them 16 at a time, and
    each answer lands in its part's place."""
    paths = [f"gs://bucket/run/clean/part-{i:05d}.parquet" for i in range(8)]
    wait = in_flight_together(4)

    def size(path: str) -> int:
        wait()
        return 1000 + int(path[-13:-8])

    assert manifest_mod.per_path(size, paths) == [1000 + i for i in range(8)]
    monkeypatch.setattr(fsio, "size", size)
    wait = in_flight_together(4)
    assert tokenizer_mod.file_sizes(paths) == [1000 + i for i in range(8)]

    # footers: 3 parts cut for 8 units, the footers read together
    def footer(path: str) -> tuple[list[int], list[int]]:
        wait()
        k = int(path[-13:-8])
        return [100] * (k + 2), [10] * (k + 2)

    wait = in_flight_together(3)
    monkeypatch.setattr(scan_mod, "_row_groups", footer)
    units = scan_mod._scan_units(paths[:3], 0.3, 8)
    assert [u.path for u in units] == sorted(u.path for u in units)
    assert [u.stop for u in units if u.path == paths[2]][-1] == 40  # its 4 groups of 10 rows


def test_the_scan_samples_the_parts_only_when_encode_cuts_them(tmp_path, monkeypatch):
    """With enough parts (UNITS_PER_WORKER a slot) each is one encode unit, so its scan sends the
    counts at its start and end only: a few numbers a part in the driver, not one a block of
    documents. With fewer, the samples (every BLOCK_ROWS rows) are where encode may cut."""
    monkeypatch.setattr(scan_mod, "BLOCK_ROWS", 4)
    files = []
    for k in range(3):
        files.append(str(tmp_path / f"part-{k}.parquet"))
        write_part(Path(files[-1]), texts_of(50 + k, seed=k))
    monkeypatch.setattr(scan_mod, "run_units", lambda fn, units, where: ((u, fn(u)) for u in units))
    found_with = {}
    for n_slots, sampled in ((1, False), (2, True)):
        monkeypatch.setattr(scan_mod, "slots", lambda where, n=n_slots: n)
        found = found_with[n_slots] = scan_mod.scan_corpus(files, 0.3, Where("local", n_slots))
        for k, f in enumerate(files):
            rows = found[f]["rows_at"].tolist()
            assert rows == ([*range(0, 50 + k, 4), 50 + k] if sampled else [0, 50 + k])
            whole = scan_mod.shard_scan_unit(scan_mod._ScanUnit(f, 0.3))
            assert found[f]["bytes_at"][-1] == whole["bytes_at"][-1]
            assert found[f]["val_at"][-1] == whole["val_at"][-1]
    # a scan without samples, then more slots at encode time (a cluster that grew): whole parts,
    # each with the documents the scan counted
    template = encode_mod.EncodeUnit(
        -1, "", "U", "tok.json", "sha", 0, 1, False, "uint16", 1000, 0.3, "fingerprint"
    )
    units = encode_mod.encode_units(files, found_with[1], 2, template)
    assert [(u.start, u.stop) for u in units] == [(0, 50), (0, 51), (0, 52)]
    assert [u.documents for u in units] == [found_with[2][f]["documents"] for f in files]
    assert len(encode_mod.encode_units(files, found_with[2], 2, template)) > 3


def test_units_count_the_scans_documents_per_range(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_mod, "BLOCK_ROWS", 4)
    scans = scans_of(tmp_path, [50, 203, 0], val_fraction=0.3)
    files = [str(tmp_path / f"part-{k}.parquet") for k in range(3)]
    template = encode_mod.EncodeUnit(
        -1, "", "U", "tok.json", "sha", 0, 1, False, "uint16", 1000, 0.3, "fingerprint"
    )
    units = encode_mod.encode_units(files, dict(zip(files, scans, strict=True)), 2, template)
    assert len(units) > 3 and [u.index for u in units] == sorted(u.index for u in units)
    for k, f in enumerate(files):
        mine = [u for u in units if u.path == f]
        assert mine[0].start == 0 and mine[-1].stop == scans[k]["rows"]
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:], strict=False))
        texts = pq.read_table(f).column(0).to_pylist()
        for u in mine:
            val = sum(corpus_mod.split_value(t) < 0.3 for t in texts[u.start : u.stop])
            assert u.documents == {"train": u.stop - u.start - val, "val": val}
    # the empty part is one empty unit; every folder names its part and rows
    assert [(u.start, u.stop) for u in units if u.index == 2] == [(0, 0)]
    assert len({u.folder for u in units}) == len(units)
    assert units[-1].folder.endswith("00002-part-2-rows-0-0")


def test_local_workers_share_the_cores():
    cores = executor.cores()
    assert encode_mod._encoder_threads(Where("local", 2), 8) == max(1, cores // 2)
    assert encode_mod._encoder_threads(Where("local", 1), 8) == 0  # here: every core
    assert encode_mod._encoder_threads(Where("local", 2), 1) == 0  # one unit runs here
    assert encode_mod._encoder_threads(Where("ray", 2), 8) == 0  # Ray's task sets 1


def test_workers_0_is_one_per_core_as_the_input_allows(monkeypatch):
    per = 1000
    monkeypatch.setattr(policy, "cores", lambda: 4)
    sizes = (0, per - 1, 2 * per, 3 * per + 1, 100 * per)
    assert [executor.auto_workers(n, per) for n in sizes] == [1, 1, 2, 3, 4]


# --- the stage -----------------------------------------------------------------------------------


def plan_for_slots(monkeypatch, n: int) -> None:
    """The stage's plan for n slots (units run side by side), whatever runs them: the encode units
    (shard.py), the scan's row ranges (scan.py) and the write tasks (write.py) are sized by it."""
    for module in (shard_mod, scan_mod, write_mod):
        monkeypatch.setattr(module, "slots", lambda where: n)


def test_the_default_workers_run_a_small_corpus_here_and_a_big_one_on_every_core(
    tmp_path, corpus, tokenizer_files, monkeypatch, caplog
):
    run = make_run(tmp_path, corpus, tokenizer_files, files=1, row_group_size=GROUP)
    assert Config().data.shard.workers == 0 and Config().data.clean.workers == 0
    with caplog.at_level(logging.INFO, logger="codex.executor"):
        small = run_shard(make_cfg(run, out=str(tmp_path / "small")))
    assert "--workers 0: 1 worker(s) for" in caplog.text
    caplog.clear()
    monkeypatch.setattr(shard_mod, "AUTO_BYTES_PER_WORKER", 1)  # the same corpus made "big"
    monkeypatch.setattr(policy, "cores", lambda: 2)
    with caplog.at_level(logging.INFO):
        big = run_shard(make_cfg(run, out=str(tmp_path / "big")))
    assert "--workers 0: 2 worker(s) for" in caplog.text
    assert "(2 run side by side)" in caplog.text  # the corpus was cut for two workers
    assert big == small


def test_one_part_is_cut_for_two_workers_and_gives_the_same_shards(
    tmp_path, corpus, tokenizer_files, monkeypatch, caplog
):
    run = make_run(tmp_path, corpus, tokenizer_files, files=1, row_group_size=GROUP)
    monkeypatch.setattr(scan_mod, "BLOCK_ROWS", 8)  # the scan of the one part runs here
    S = 700
    one = run_shard(make_cfg(run, out=str(tmp_path / "w1"), shard_tokens=S))
    with caplog.at_level(logging.INFO, logger="codex.shard"):
        two = run_shard(make_cfg(run, out=str(tmp_path / "w2"), shard_tokens=S, workers=2))
    # 8 units, the last 2 cut smaller (some of the tail's cuts fall on the same sampled row)
    n = int(re.search(r"1 parts cut into (\d+) encode units", caplog.text)[1])
    assert 8 < n <= 6 + 2 * (encode_mod.TAIL_HALVINGS + 1)
    assert f"encoded {n} of {n} units of 1 parts" in caplog.text
    assert two == one and len(one["shards"]) >= 6
    for e in one["shards"]:
        w1, w2 = tmp_path / "w1" / e["path"], tmp_path / "w2" / e["path"]
        assert w1.read_bytes() == w2.read_bytes()
    ref, _ = reference_shards(run, corpus, make_cfg(run, shard_tokens=S), files=1)
    for split in ("train", "val"):
        entries = [e for e in one["shards"] if e["split"] == split]
        assert [e["sha256"] for e in entries] == [npy_sha(t) for t in ref[split]]
    assert verify_shards(str(tmp_path / "w2")) == []


def test_a_stopped_run_of_cut_parts_resumes_its_ranges(
    tmp_path, corpus, tokenizer_files, monkeypatch
):
    run = make_run(tmp_path, corpus, tokenizer_files, files=2, row_group_size=GROUP)
    ref = run_shard(make_cfg(run, out=str(tmp_path / "ref"), shard_tokens=700))
    monkeypatch.setattr(scan_mod, "BLOCK_ROWS", 8)
    # the plan of 2 workers (8 units, the last 2 cut smaller), run in this process
    plan_for_slots(monkeypatch, 2)
    encode = encode_mod.shard_encode_unit
    seen: list[tuple] = []

    def stops_at_the_fourth(u):
        if len(seen) == 3:
            raise Stopped
        seen.append((u.index, u.start, u.stop))
        return encode(u)

    monkeypatch.setattr(encode_mod, "shard_encode_unit", stops_at_the_fourth)
    cfg = make_cfg(run, shard_tokens=700)
    with pytest.raises(Stopped):
        run_shard(cfg)
    units = run / "shards" / ".units"
    part = "part-00000-00000-000"
    done = {p.parent.name for p in units.glob("*/done.json")}
    assert done == {f"00000-{part}-rows-{a}-{b}" for _, a, b in seen}
    marker = json.loads((units / f"00000-{part}-rows-0-{seen[0][2]}" / "done.json").read_text())
    assert marker["part"] == f"{part}.parquet" and marker["rows"] == [0, seen[0][2]]
    # a marker whose rows are not its folder's is not trusted
    marker["rows"] = [0, 8]
    _, a, b = seen[1]
    (units / f"00000-{part}-rows-{a}-{b}" / "done.json").write_text(json.dumps(marker))

    first = list(seen)
    seen.clear()
    monkeypatch.setattr(encode_mod, "shard_encode_unit", lambda u: seen.append(u) or encode(u))
    assert run_shard(cfg) == ref
    redone = [(u.index, u.start, u.stop) for u in seen]
    assert first[0] not in redone and first[1] in redone and first[2] not in redone
    assert len(redone) == len(set(first) | set(redone)) - 2  # the rest of the plan, once each
    assert not units.exists() and verify_shards(str(run / "shards")) == []


def test_a_rerun_that_cuts_elsewhere_never_takes_another_ranges_files(
    tmp_path, corpus, tokenizer_files, monkeypatch
):
    run = make_run(tmp_path, corpus, tokenizer_files, files=1, row_group_size=GROUP)
    ref = run_shard(make_cfg(run, out=str(tmp_path / "ref"), shard_tokens=700))
    monkeypatch.setattr(scan_mod, "BLOCK_ROWS", 8)
    plan_for_slots(monkeypatch, 2)
    encode = encode_mod.shard_encode_unit
    count = [0]

    def stops_at_the_sixth(u):
        count[0] += 1
        if count[0] == 6:
            raise Stopped
        return encode(u)

    monkeypatch.setattr(encode_mod, "shard_encode_unit", stops_at_the_sixth)
    cfg = make_cfg(run, shard_tokens=700)
    with pytest.raises(Stopped):
        run_shard(cfg)
    # the rerun has one worker: the part is one unit, whatever ranges are done
    plan_for_slots(monkeypatch, 1)
    seen = []
    monkeypatch.setattr(encode_mod, "shard_encode_unit", lambda u: seen.append(u) or encode(u))
    assert run_shard(cfg) == ref
    assert [(u.start, u.stop) for u in seen] == [(0, len(corpus))]
    for e in ref["shards"]:
        got = np.load(run / "shards" / e["path"])
        assert npy_sha(got) == e["sha256"]


@pytest.mark.slow
def test_ray_cuts_one_part_for_the_clusters_cpus_and_gives_the_same_shards(
    tmp_path, tokenizer_files, ray_cluster, caplog
):
    docs = make_docs(600, seed=1)  # ten blocks of 64 rows: cuts for 8 units
    run = make_run(tmp_path, docs, tokenizer_files, files=1, row_group_size=GROUP)
    ref = run_shard(make_cfg(run, out=str(tmp_path / "w1"), shard_tokens=2000))
    cfg = make_cfg(run, out=str(tmp_path / "ray"), shard_tokens=2000)
    cfg.data.executor, cfg.data.ray_address = "ray", ray_cluster
    with caplog.at_level(logging.INFO, logger="codex.shard"):
        got = run_shard(cfg)
    # two raylets of one CPU each: 4 x 2 units, the last 2 cut smaller (on 64-row blocks)
    n = int(re.search(r"1 parts cut into (\d+) encode units", caplog.text)[1])
    assert 8 < n <= 6 + 2 * (encode_mod.TAIL_HALVINGS + 1)
    assert "(2 run side by side)" in caplog.text
    assert got == ref and len(ref["shards"]) >= 4
    for e in ref["shards"]:
        ray, w1 = tmp_path / "ray" / e["path"], tmp_path / "w1" / e["path"]
        assert ray.read_bytes() == w1.read_bytes()
