"""`codex eval`, `sample` and `export` on bad input, through the real CLI: usage mistakes, an
unreadable checkpoint, a retrained tokenizer, a damaged validation shard, an lm-eval task whose
dataset is offline; and export's files follow the umask. Policy: docs/bad-input.md."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from tests.fixtures.bad_input import invoke


@pytest.mark.parametrize(
    "args, code, pattern",
    [
        (["eval", "--checkpoint", "abc"], 2, "eval.checkpoint='abc'"),
        (["eval", "--max-tokens", "-5"], 2, "eval.max_tokens=-5"),
        (["eval", "--checkpoint", "99"], 2, "no complete checkpoint"),
        (
            ["eval", "--data", "{run}/shards/train_00000.npy"],
            1,
            "train_00000.npy: unsupported file type",
        ),
        (["eval", "--checkpoint", "12"], 1, "not a readable checkpoint"),
        (["sample", "--prompt", "def", "--checkpoint", "12"], 1, "not a readable checkpoint"),
        (["sample", "--prompt", "def", "--max-new-tokens", "-1"], 2, "eval.max_new_tokens=-1"),
        (["sample", "--prompt", "def", "--temperature", "-0.5"], 2, "eval.temperature=-0.5"),
    ],
)
def test_eval_and_sample_mistakes(run, args, code, pattern):
    junk = run / "checkpoints" / "step_00000012"
    junk.mkdir()
    (junk / "ckpt.pt").write_bytes(b"not a checkpoint")
    (junk / "DONE").write_text(json.dumps({"step": 12, "bytes": 16}))
    invoke([*[a.format(run=run) for a in args], "--run", str(run)], code, pattern)


def test_eval_and_sample_refuse_a_retrained_tokenizer(run):
    invoke(["sample", "--run", str(run), "--prompt", "def", "--max-new-tokens", "2"], 0)
    meta_path = run / "tokenizer" / "tokenizer_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["sha256"] = "f" * 64  # as if retrained after training
    meta_path.write_text(json.dumps(meta))
    for cmd in (["sample", "--prompt", "def"], ["eval"]):
        invoke([*cmd, "--run", str(run)], 1, "is not the tokenizer", "was trained with")
    assert not (run / "eval").exists() or not any((run / "eval").glob("step_*.json"))


def test_eval_refuses_a_damaged_validation_shard(run):
    shard = run / "shards" / "val_00000.npy"
    data = bytearray(shard.read_bytes())
    data[-4] ^= 0x01  # the low byte of the next-to-last token: another valid id, a valid .npy
    shard.write_bytes(bytes(data))
    invoke(["eval", "--run", str(run)], 1, "val_00000.npy", "sha256")
    assert not list((run / "eval").glob("step_*.json"))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_files_follow_the_umask(run, tmp_path, monkeypatch, umask):
    """A shared model directory: every file and folder as the umask says (0644 / 0755 by
    default), not tempfile's 0600 / 0700."""
    pytest.importorskip("transformers")
    from codex.core import fsio

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(fsio, "_UMASK", umask)
    old = os.umask(umask)
    try:
        invoke(["export", "--run", str(run), "--format", "hf", "--out", str(tmp_path / "hf")], 0)
        invoke(
            ["export", "--run", str(run), "--format", "torch", "--out", str(tmp_path / "m.pt")], 0
        )
    finally:
        os.umask(old)
    hf = tmp_path / "hf"
    dirs = [hf, *(p for p in hf.rglob("*") if p.is_dir())]
    files = [p for p in hf.rglob("*") if p.is_file()]
    assert {p.stat().st_mode & 0o777 for p in dirs} == {0o777 & ~umask}
    assert files and {p.stat().st_mode & 0o777 for p in files} == {0o666 & ~umask}
    assert (tmp_path / "m.pt").stat().st_mode & 0o777 == 0o666 & ~umask


def _missing_task(folder: Path) -> Path:
    """A local lm-eval task whose dataset is on no machine (never downloaded)."""
    folder.mkdir()
    (folder / "codex_missing.yaml").write_text(
        "task: codex_missing\n"
        "dataset_path: codex-test-org/not-downloaded\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n"
        "  - metric: acc\n"
    )
    return folder


def test_an_offline_task_fails_fast_naming_the_task(run, tmp_path, monkeypatch, caplog):
    """The hub does not answer (a blackholed address) and the dataset is not cached: one line
    naming the task within seconds, not after a minute of retries; nothing written."""
    pytest.importorskip("lm_eval")
    import time

    import lm_eval.tasks  # noqa: F401 - imported before the clock starts

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "")  # recorded, so that teardown removes what codex sets
        monkeypatch.delenv(var)
    monkeypatch.setenv("HF_ENDPOINT", "https://10.255.255.1")
    tasks = _missing_task(tmp_path / "tasks")
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="codex.eval"):
        invoke(
            ["eval", "--run", str(run), "--tasks", "codex_missing", "--tasks-path", str(tasks)],
            1,
            "task codex_missing: its dataset could not be loaded",
        )
    took = time.monotonic() - started
    assert took < 20, f"{took:.1f} s"
    assert any("does not answer" in r.getMessage() for r in caplog.records)
    assert not list((run / "eval").glob("*.tasks-*.json"))
    invoke(
        [
            "eval",
            "--run",
            str(run),
            "--tasks",
            "codex_missing",
            "--tasks-path",
            str(tmp_path / "x"),
        ],
        2,
        "eval.tasks_path",
        "not a directory",
    )
