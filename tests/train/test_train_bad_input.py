"""`codex train` on bad input, through the real CLI: config mistakes (exit 2 before any run file is
read), a batch that cannot fit, data that does not match the run (a damaged shard, another
tokenizer or vocab) and resumes under another seq_len, batch, model or optimizer.
Policy: docs/bad-input.md."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from codex.core.config import build_config
from codex.train.plan.memory import Setting, plan
from codex.train.plan.presets import get_preset
from tests.fixtures.bad_input import TRAIN, files_under, invoke, retokenized, warnings_with


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["--set", "train.lr=-0.001"], "train.lr=-0.001 is out of range: expected >= 0"),
        (["--device-batch", "-2"], "train.device_batch=-2"),
        (["--set", "model.mlp=foo"], "model.mlp: expected one of swiglu, relu2"),
        (["--set", "train.resume=sometimes"], "train.resume"),
        (["--set", "model.n_layerz=2"], "did you mean 'model.n_layer'"),
        (["--set", "model.n_head=3"], "model.n_embd=32 must be divisible by model.n_head=3"),
        (["--set", "model.n_kv_head=3"], "model.n_head=2 must be a multiple of model.n_kv_head=3"),
        (["--config", "/nonexistent.yaml"], "config file not found"),
        (["--max-steps", "-1"], "train.max_steps=-1 is out of range"),
        (["--seq-len", "-16"], "train.seq_len=-16 is out of range"),
        (["--set", "train.max_steps=ten"], "train.max_steps: expected an integer, got 'ten'"),
        # NaN compares false with every bound: a range check must not let it through
        (["--set", "train.lr=nan"], "train.lr=nan is out of range"),
        (["--nproc-per-node", "abc"], "'abc' is not a valid integer"),
    ],
)
def test_train_config_mistakes_exit_2_before_any_run_file_is_read(tmp_path, extra, pattern):
    # The run directory does not exist: a check that came after reading it would say so instead.
    invoke(["train", "--run", str(tmp_path / "no-such-run"), *TRAIN, *extra], 2, pattern)
    assert not (tmp_path / "no-such-run").exists()  # nothing written either


@pytest.mark.parametrize("n", ["0", "-1"])
def test_nproc_per_node_below_one_is_a_usage_error(tmp_path, n):
    invoke(
        ["train", "--run", str(tmp_path / "no-such-run"), *TRAIN, "--nproc-per-node", n],
        2,
        "--nproc-per-node",
    )


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("train:\n  max_steps: ten\n", "train.max_steps: expected an integer, got 'ten'"),
        ("train: 5\n", "train: expected a mapping, got 5"),
        ("- train\n- model\n", "config: expected a mapping"),
        ("train:\n  wandb: off\n", "train.wandb: expected a string, got False"),
    ],
)
def test_a_config_file_with_a_wrong_type_names_the_key(tmp_path, text, pattern):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    run = tmp_path / "no-such-run"
    invoke(["train", "--run", str(run), "--config", str(f), *TRAIN], 2, pattern)
    assert not run.exists()


def test_invalid_yaml_names_the_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: [1,\n")
    invoke(["train", "--config", str(f)], 2, "c.yaml line", "invalid YAML")


def test_a_batch_that_cannot_fit_is_refused_with_the_estimate(run):
    invoke(
        ["train", "--run", str(run), *TRAIN, "--max-steps", "5", "--device-batch", "10000000"],
        2,
        "train.device_batch=10000000",
        "GB",
        "Fix: train.device_batch=",
    )
    # The default 4x128 model, vocab 32768, 2000 x 256 on the CPU: OOM-killed when not refused.
    m = build_config().model
    m.vocab_size = 32768
    assert plan(m, get_preset("cpu"), 2000, 256, Setting(dtype="fp32")).total > 100e9


def test_warmup_longer_than_the_run_warns_and_a_finished_run_has_nothing_to_do(run, caplog):
    with caplog.at_level(logging.WARNING):
        invoke(["train", "--run", str(run), *TRAIN, "--max-steps", "2"], 0)
    assert "nothing to do: the checkpoint is at step 3 and this run ends at step 2" in caplog.text
    shutil.rmtree(run / "checkpoints")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        invoke(
            ["train", "--run", str(run), *TRAIN, "--set=train.warmup_steps=50", "--max-steps", "2"],
            0,
        )
    assert "train.warmup_steps=50 covers the whole run (2 steps)" in caplog.text


def test_train_refuses_a_damaged_shard_the_first_time_it_opens_it(run):
    shard = run / "shards" / "train_00000.npy"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: still a valid .npy of the right shape
    shard.write_bytes(bytes(data))
    invoke(["train", "--run", str(run), *TRAIN, "--max-steps", "5"], 1, "train_00000.npy", "sha256")


def test_train_refuses_shards_made_with_another_tokenizer(run):
    retokenized(run, "e" * 64)
    invoke(
        ["train", "--run", str(run), *TRAIN, "--max-steps", "5"],
        1,
        "manifest.json",
        "another tokenizer",
    )


def test_train_refuses_to_resume_under_another_tokenizer(run):
    retokenized(run, "e" * 64)
    manifest_path = run / "shards" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tokenizer"]["sha256"] = (
        "e" * 64
    )  # shards remade with it too: only the resume is wrong
    manifest_path.write_text(json.dumps(manifest))
    invoke(
        ["train", "--run", str(run), *TRAIN, "--max-steps", "5"],
        1,
        "step 3 was trained with another tokenizer",
    )


def test_resume_after_the_tokenizer_and_shards_were_remade_names_the_tokenizer(run):
    """Another tokenizer and shards made with it (another window count): the refusal names the
    tokenizer, which is the cause, not the loader's window count, which is its consequence."""
    shutil.rmtree(run / "tokenizer")
    shutil.rmtree(run / "shards")
    (run / "checkpoints").rename(run.parent / "aside")  # as if copied in from another run
    invoke(["data", "tokenize", "--run", str(run), "--vocab-size", "280"], 0)
    invoke(["data", "shard", "--run", str(run), "--val-fraction", "0.1"], 0)
    (run.parent / "aside").rename(run / "checkpoints")
    out = invoke(
        ["train", "--run", str(run), *TRAIN, "--max-steps", "5"],
        1,
        "step 3 was trained with another tokenizer",
    )
    assert "windows=" not in out


def test_train_refuses_shards_of_another_vocab_size_as_bad_data(run):
    manifest_path = run / "shards" / "manifest.json"
    m = json.loads(manifest_path.read_text())
    m["tokenizer"]["vocab_size"] = 512
    manifest_path.write_text(json.dumps(m))
    invoke(
        ["train", "--run", str(run), *TRAIN, "--max-steps", "5"],
        1,
        "manifest.json",
        "vocab_size 512",
    )


@pytest.mark.parametrize("fresh", [True, False])
def test_a_seq_len_above_the_models_max_is_refused(run, fresh):
    if fresh:
        shutil.rmtree(run / "checkpoints")
    before = files_under(run)
    invoke(
        ["train", "--run", str(run), *TRAIN, "--seq-len", "64", "--max-steps", "5"],
        2,
        "train.seq_len=64 is longer than model.max_seq_len=32",
    )
    assert files_under(run) == before  # nothing written: no checkpoint, config or metrics


def test_a_resume_with_another_seq_len_is_refused_naming_both(run):
    before = files_under(run / "checkpoints")
    metrics = (run / "metrics.jsonl").read_bytes()
    invoke(
        ["train", "--run", str(run), *TRAIN, "--seq-len", "32", "--max-steps", "5"],
        1,
        "seq_len=16",
        "seq_len=32",
    )
    assert files_under(run / "checkpoints") == before
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_a_resume_with_another_batch_says_what_changed_in_one_line(run, caplog):
    with caplog.at_level(logging.WARNING):
        invoke(["train", "--run", str(run), *TRAIN, "--device-batch", "4", "--max-steps", "4"], 0)
    (changed,) = warnings_with(caplog, "resuming with")
    assert "64 tokens per step on 1 ranks" in changed and "trained with 32 on 1" in changed
    assert (run / "checkpoints" / "step_00000004" / "DONE").exists()


@pytest.mark.parametrize(
    "change, pattern",
    [
        ("model.n_layer=3", "model.n_layer=3 differs from the checkpoint's 2"),
        ("train.optimizer=adamw", "train.optimizer=muon, this run uses adamw"),
    ],
)
def test_a_resume_with_another_model_or_optimizer_is_refused_naming_the_key(run, change, pattern):
    before = files_under(run / "checkpoints")
    invoke(["train", "--run", str(run), *TRAIN, f"--set={change}", "--max-steps", "5"], 2, pattern)
    assert files_under(run / "checkpoints") == before
