"""codex data shard and verify on bad input. run_shard: a missing or changed tokenizer, a dtype too
small for the vocab, a val fraction too small, an empty corpus or a bad parquet file. The real CLI
on a copy of the finished run (`run`, tests/conftest.py): usage mistakes, a manifest with a path
outside its folder, no checksum or no JSON, a truncated clean part or tokenizer, an unlisted shard
file. Policy: docs/bad-input.md."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codex.pipeline.shard import shard as shard_mod
from codex.pipeline.shard.errors import ShardDataError, ShardError
from codex.pipeline.shard.shard import run_shard
from codex.pipeline.shard.verify import verify_shards
from tests.fixtures.bad_input import TRAIN, files_under, invoke
from tests.fixtures.shard import make_cfg, make_run, write_tokenizer


def test_missing_or_changed_tokenizer(tmp_path, corpus, tokenizer_files):
    run = make_run(tmp_path, corpus, tokenizer_files)
    os.rename(run / "tokenizer", run / "tok_away")
    with pytest.raises(ShardError, match="codex data tokenize"):
        run_shard(make_cfg(run))
    os.rename(run / "tok_away", run / "tokenizer")
    run_shard(make_cfg(run))
    write_tokenizer(run, corpus, vocab_size=350)  # another tokenizer under the same run
    with pytest.raises(ShardError, match="made with another tokenizer"):
        run_shard(make_cfg(run))
    assert any(
        "were made with" in p for p in verify_shards(str(run / "shards"), str(run / "tokenizer"))
    )
    # edited after training: sha256 mismatch
    (run / "tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(ShardDataError, match="does not match"):
        run_shard(make_cfg(run, out=str(tmp_path / "other")))


def test_dtype_too_small_for_vocab():
    with pytest.raises(ShardError, match="cannot hold vocab_size 70000"):
        shard_mod._dtype_for(70000, "uint16", "RUN/tokenizer")
    assert shard_mod._dtype_for(70000, "auto", "x") == "uint32"
    assert shard_mod._dtype_for(65536, "auto", "x") == "uint16"


def test_val_fraction_too_small_suggests_a_value(tmp_path, corpus, tokenizer_files):
    run = make_run(tmp_path, corpus, tokenizer_files)
    with pytest.raises(ShardError, match=r"--val-fraction ([0-9.]+)") as e:
        run_shard(make_cfg(run, val_fraction=1e-6))
    assert not (run / "shards" / "manifest.json").exists()
    suggested = float(e.value.args[0].split("--val-fraction ")[1].split()[0])
    m = run_shard(make_cfg(run, val_fraction=suggested))
    assert m["totals"]["val"]["documents"] >= 1


def test_empty_corpus_and_bad_parquet(tmp_path, corpus, tokenizer_files):
    run = make_run(tmp_path, [], tokenizer_files)
    with pytest.raises(ShardError, match="empty corpus"):
        run_shard(make_cfg(run))
    for p in (run / "clean").glob("*.parquet"):
        p.unlink()
    with pytest.raises(
        FileNotFoundError, match="part-00000-00000-000.parquet: listed in .*stats.json but missing"
    ):
        run_shard(make_cfg(run))
    (run / "clean" / "stats.json").write_text(
        json.dumps({"shards": ["part-00000-00000-000.parquet"]})
    )
    pq.write_table(pa.table({"text": ["ok", None]}), run / "clean" / "part-00000-00000-000.parquet")
    with pytest.raises(ShardDataError, match="part-00000-00000-000.parquet: row 1: text is null"):
        run_shard(make_cfg(run))
    pq.write_table(pa.table({"body": ["ok"]}), run / "clean" / "part-00000-00000-000.parquet")
    with pytest.raises(ShardDataError, match="no 'text' column"):
        run_shard(make_cfg(run))


@pytest.mark.parametrize(
    "args, code, pattern",
    [
        (["data", "tokenize", "--vocab-size", "100"], 2, "data.tokenizer.vocab_size=100"),
        (["data", "tokenize"], 2, "run `codex data clean` first"),
        (["data", "shard", "--set", "data.shard.format=zip"], 2, "data.shard.format"),
        (["data", "shard", "--val-fraction", "1.5"], 2, "data.shard.val_fraction=1.5"),
        # no validation split, or nothing to train on
        (
            ["data", "shard", "--val-fraction", "0"],
            2,
            "data.shard.val_fraction=0.0 is out of range",
        ),
        (
            ["data", "shard", "--val-fraction", "1"],
            2,
            "data.shard.val_fraction=1.0 is out of range",
        ),
        (
            ["data", "shard", "--set", "data.shard.shard_tokens=0"],
            2,
            "data.shard.shard_tokens=0 is out of range",
        ),
        (["data", "verify", "{tmp}/a", "--run", "{tmp}/b"], 2, "two run directories"),
        (["data", "verify", "{tmp}/never"], 1, "1 problem(s)"),
    ],
)
def test_data_stage_usage(tmp_path, args, code, pattern):
    args = [a.format(tmp=tmp_path) for a in args]
    if args[1] != "verify":
        args += ["--run", str(tmp_path / "empty")]
    out = invoke(args, code, pattern)
    if args[1] == "verify" and code == 1:
        assert "no shards here" in out and "never finished" not in out


@pytest.mark.parametrize("bad_path", ["../../elsewhere/train_00000.npy", "/etc/passwd"])
def test_manifest_paths_outside_the_shards_folder_are_refused(run, bad_path):
    manifest_path = run / "shards" / "manifest.json"
    m = json.loads(manifest_path.read_text())
    m["shards"][0]["path"] = bad_path
    manifest_path.write_text(json.dumps(m))
    out = invoke(["data", "verify", str(run)], 1, "problem(s)")
    assert f"path {bad_path!r} is not inside" in out
    invoke(
        ["train", "--run", str(run), *TRAIN, "--max-steps", "5"], 1, "shards[0].path", "not inside"
    )


def test_a_manifest_entry_without_its_checksum_is_a_problem_not_a_crash(run):
    manifest_path = run / "shards" / "manifest.json"
    m = json.loads(manifest_path.read_text())
    del m["shards"][0]["sha256"]
    manifest_path.write_text(json.dumps(m))
    out = invoke(["data", "verify", str(run)], 1, "problem(s)")
    assert "shards[0] has no 'sha256'" in out


@pytest.mark.parametrize("stage", ["shard", "tokenize"])
def test_a_truncated_cleaned_part_stops_the_stage_naming_it(run, stage):
    part = sorted((run / "clean").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "shards")
    if stage == "tokenize":
        shutil.rmtree(run / "tokenizer")
    invoke(["data", stage, "--run", str(run)], 1, str(part), "not a readable parquet file")
    assert not (run / "shards" / "manifest.json").exists()
    assert (run / "tokenizer").exists() == (stage == "shard")  # no tokenizer from part of it


@pytest.mark.parametrize("vouched", [False, True])
def test_shard_refuses_a_truncated_tokenizer_json_as_bad_data(run, vouched):
    """Cut in half; `vouched`: with a meta rewritten to match, so the file itself cannot be
    parsed (tokenizers raises a bare Exception)."""
    import hashlib

    tok = run / "tokenizer" / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[: tok.stat().st_size // 2])
    if vouched:
        meta_path = run / "tokenizer" / "tokenizer_meta.json"
        meta = json.loads(meta_path.read_text())
        meta["sha256"] = hashlib.sha256(tok.read_bytes()).hexdigest()
        meta_path.write_text(json.dumps(meta))
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "shards")
    invoke(
        ["data", "shard", "--run", str(run)],
        1,
        str(tok),
        "not a readable tokenizer" if vouched else "does not match",
    )
    assert not (run / "shards" / "manifest.json").exists()


def test_a_manifest_that_is_not_json_is_one_line_for_verify_train_and_eval(run):
    manifest = run / "shards" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    out = invoke(["data", "verify", str(run)], 1, "1 problem(s)")
    assert "unreadable manifest" in out
    before = files_under(run / "checkpoints")
    for cmd in (["train", *TRAIN, "--max-steps", "5"], ["eval"]):
        invoke([*cmd, "--run", str(run)], 1, str(manifest), "not valid JSON")
    assert files_under(run / "checkpoints") == before


def test_an_unlisted_shard_file_is_reported_by_verify_and_ignored_by_train(run):
    extra = run / "shards" / "train_00099.npy"
    np.save(extra, np.arange(50, dtype=np.uint16))
    out = invoke(["data", "verify", str(run)], 1, "1 problem(s)")
    assert f"{extra}: a shard file that manifest.json does not list" in out
    invoke(["train", "--run", str(run), *TRAIN, "--max-steps", "4"], 0)
    assert (run / "checkpoints" / "step_00000004" / "DONE").exists()
