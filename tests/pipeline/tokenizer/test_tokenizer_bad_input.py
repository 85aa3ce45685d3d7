"""`codex data tokenize` refusing to retrain under shards or checkpoints, and a damaged
tokenizer.json or tokenizer_meta.json met by sample, verify and train: one line each, through the
real CLI on a copy of the finished run (`run`, tests/conftest.py). Policy: docs/bad-input.md."""

from __future__ import annotations

import shutil

from tests.fixtures.bad_input import TRAIN, files_under, invoke


def test_tokenize_refuses_to_retrain_under_shards_and_checkpoints(run):
    before = files_under(run / "tokenizer")
    invoke(
        ["data", "tokenize", "--run", str(run), "--vocab-size", "320"],
        2,
        "would be retrained",
        "shards",
        "checkpoints",
        "new --run",
    )
    assert files_under(run / "tokenizer") == before  # nothing overwritten


def test_tokenize_under_shards_reruns_only_as_a_no_op(run):
    """With shards built (no checkpoints): the same settings are a no-op; anything that would
    write RUN/tokenizer is refused with one line saying how to start over."""
    shutil.rmtree(run / "checkpoints")
    before = files_under(run / "tokenizer")
    invoke(["data", "tokenize", "--run", str(run), "--vocab-size", "300"], 0)
    assert files_under(run / "tokenizer") == before  # identical settings: nothing rewritten
    out = invoke(
        ["data", "tokenize", "--run", str(run), "--vocab-size", "320"],
        2,
        "would be retrained",
        "shards",
        "new --run",
        "delete",
    )
    assert "checkpoints" not in out
    assert files_under(run / "tokenizer") == before
    shutil.rmtree(run / "tokenizer")  # no tokenizer, but shards made with one
    invoke(
        ["data", "tokenize", "--run", str(run), "--vocab-size", "300"],
        2,
        "would be trained",
        "shards",
        "new --run",
    )
    assert not (run / "tokenizer" / "tokenizer_meta.json").exists()


def test_a_truncated_tokenizer_json_is_one_line_naming_it(run):
    tok = run / "tokenizer" / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[: tok.stat().st_size // 2])
    invoke(["sample", "--run", str(run), "--prompt", "def"], 1, str(tok), "does not match")
    out = invoke(["data", "verify", str(run)], 1, "1 problem(s)")
    assert "tokenizer.json has sha256" in out


def test_a_tokenizer_meta_that_is_not_an_object_is_one_line(run):
    meta = run / "tokenizer" / "tokenizer_meta.json"
    meta.write_text("[300]")
    for cmd in (["train", *TRAIN, "--max-steps", "5"], ["sample", "--prompt", "def"]):
        invoke([*cmd, "--run", str(run)], 1, str(meta), "JSON object")
