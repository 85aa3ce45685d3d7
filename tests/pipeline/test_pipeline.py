"""The stages chain through one run directory: clean -> tokenize -> shard -> train -> eval, via
the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from codex.cli.main import cli
from tests.fixtures.clean import pipeline_corpus  # noqa: F401


def _invoke(args):
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res


@pytest.mark.slow
def test_stages_chain_through_the_run_directory(tmp_path):
    pipeline_corpus(tmp_path / "src")
    run = str(tmp_path / "run")
    common = ["--run", run]
    _invoke(
        [
            "data",
            "clean",
            *common,
            "--input",
            str(tmp_path / "src"),
            "--preset",
            "code",
            "--set",
            "data.clean.text_extensions=[.py]",
        ]
    )
    stats = json.loads((tmp_path / "run" / "clean" / "stats.json").read_text())
    assert stats["docs_out"] == 120

    _invoke(["data", "tokenize", *common, "--vocab-size", "320"])
    meta = json.loads((tmp_path / "run" / "tokenizer" / "tokenizer_meta.json").read_text())
    assert meta["special_ids"] == {"bos": 0, "eos": 1, "pad": 2}

    _invoke(["data", "shard", *common, "--shard-tokens", "20000", "--val-fraction", "0.1"])
    manifest = json.loads((tmp_path / "run" / "shards" / "manifest.json").read_text())
    assert manifest["totals"]["train"]["documents"] + manifest["totals"]["val"]["documents"] == 120
    assert manifest["totals"]["val"]["documents"] > 0
    first = np.load(tmp_path / "run" / "shards" / manifest["shards"][0]["path"], mmap_mode="r")
    assert first[0] == meta["special_ids"]["bos"]  # every document starts with <|bos|>

    _invoke(
        [
            "train",
            *common,
            "--model",
            "tiny",
            "--max-steps",
            "4",
            "--device-batch",
            "4",
            "--seq-len",
            "32",
            "--wandb",
            "off",
            "--set",
            "train.eval_every=2",
            "--set",
            "train.save_every=2",
            "--set",
            "train.log_every=1",
        ]
    )
    assert (tmp_path / "run" / "checkpoints" / "step_00000004" / "DONE").exists()
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    # the loss plot is redrawn at each validation, before any `codex eval`
    plot = tmp_path / "run" / "eval" / "loss.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    res = _invoke(["eval", *common])
    out = json.loads((tmp_path / "run" / "eval" / "step_4.json").read_text())
    assert math.isclose(out["perplexity"], math.exp(out["loss"]), rel_tol=1e-6)
    assert 0 < out["bits_per_byte"] < 8 and out["tokens"] > 0
    assert "perplexity" in res.output
    # the val numbers the training loop logged at step 4 are the same evaluation
    val = [r for r in rows if r["kind"] == "val" and r["step"] == 4]
    assert val and math.isclose(val[0]["loss"], out["loss"], rel_tol=1e-5)


def test_demo_redoes_outputs_made_with_another_tokenizer(tmp_path):
    import json

    from codex.cli.demo import drop_stale_outputs

    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer_meta.json").write_text(json.dumps({"sha256": "a" * 64}))
    for d in ("shards", "checkpoints/step_00000010", "eval"):
        (run / d).mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "shards" / "manifest.json").write_text(
        json.dumps({"settings": {"tokenizer_sha256": "a" * 64}})
    )
    drop_stale_outputs(str(run))  # same tokenizer: everything kept
    assert (run / "shards" / "manifest.json").exists() and (run / "checkpoints").exists()
    (run / "shards" / "manifest.json").write_text(
        json.dumps({"settings": {"tokenizer_sha256": "b" * 64}})
    )
    drop_stale_outputs(str(run))
    assert not any((run / d).exists() for d in ("shards", "checkpoints", "eval", "metrics.jsonl"))
    assert (run / "tokenizer" / "tokenizer_meta.json").exists()
    drop_stale_outputs(str(run))  # nothing there: nothing to do
