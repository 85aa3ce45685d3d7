"""codex data shard on bad input: a missing or changed tokenizer, a dtype too small for the vocab, a
val fraction too small, an empty corpus or a bad parquet file."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codex.pipeline.shard import shard as shard_mod
from codex.pipeline.shard.errors import ShardDataError, ShardError
from codex.pipeline.shard.shard import run_shard
from codex.pipeline.shard.verify import verify_shards
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
