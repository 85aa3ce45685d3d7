"""`codex data shard` over several cleaned runs (data.shard.sources): each source's shards are the
ones its run alone gives, the manifest tags and counts them per source, the loader draws them by
weight, a rerun is a no-op and other sources are refused."""

from __future__ import annotations

import json

import pytest

from codex.pipeline.shard.errors import ShardError
from codex.pipeline.shard.shard import run_shard
from codex.pipeline.shard.verify import verify_shards
from codex.train.data.mixture import Mixture, MixtureLoader
from tests.fixtures.shard import make_cfg, make_run


@pytest.fixture
def runs(tmp_path, corpus, tokenizer_files):
    half = len(corpus) // 2
    web = make_run(tmp_path, corpus[:half], tokenizer_files, name="web", files=2)
    code = make_run(tmp_path, corpus[half:], tokenizer_files, name="code", files=1)
    mix = make_run(tmp_path, corpus[:2], tokenizer_files, name="mix", files=1)
    return web, code, mix


def test_sources_are_sharded_apart_and_counted(runs, tmp_path):
    web, code, mix = runs
    alone = {name: run_shard(make_cfg(run)) for name, run in (("web", web), ("code", code))}
    m = run_shard(make_cfg(mix, sources={"web": str(web), "code": str(code)}))
    out = mix / "shards"
    assert list(m["sources"]) == ["web", "code"]
    for name, single in alone.items():
        mine = [e for e in m["shards"] if e["source"] == name]
        # the same bytes as the source's run sharded alone, in the source's folder
        assert [(e["path"], e["sha256"]) for e in mine] == [
            (f"{name}/{e['path']}", e["sha256"]) for e in single["shards"]
        ]
        for sp in ("train", "val"):
            assert m["sources"][name]["tokens"][sp] == single["totals"][sp]["tokens"]
    for sp in ("train", "val"):
        assert m["totals"][sp]["tokens"] == sum(t["tokens"][sp] for t in m["sources"].values())
    assert verify_shards(str(out), str(mix / "tokenizer")) == []
    assert json.loads((out / "manifest.json").read_text()) == m
    # a rerun finds everything done and writes the same manifest
    assert run_shard(make_cfg(mix, sources={"web": str(web), "code": str(code)})) == m
    # the loader draws the sources by weight
    loader = MixtureLoader(str(out), 16, 4, Mixture({"web": 1, "code": 1}), prefetch=0)
    assert [s.name for s in loader.sources] == ["web", "code"]
    next(loader)
    assert loader.state_dict()["mixture"]["sources"]["code"]["drawn"] == 2


def test_other_sources_are_refused(runs):
    web, code, mix = runs
    run_shard(make_cfg(mix, sources={"web": str(web), "code": str(code)}))
    with pytest.raises(ShardError, match="other sources.*sources"):
        run_shard(make_cfg(mix, sources={"web": str(web)}))


def test_a_source_without_a_finished_clean_is_named(runs, tmp_path):
    web, _, mix = runs
    with pytest.raises(FileNotFoundError, match="data.shard.sources.nope: .*stats.json"):
        run_shard(make_cfg(mix, sources={"web": str(web), "nope": str(tmp_path / "none")}))
