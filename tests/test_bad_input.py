"""Bad input and misuse across every stage, in one place: the whole error policy.

    exit 1  bad data (a file, line or key named), nothing lost, no completion marker left behind
    exit 2  usage or config (a key and its allowed values named), before any run file is read
    always  one line, never a traceback (CODEX_DEBUG=1 shows it)

Each case runs the real CLI (click's runner, exceptions not caught: a traceback fails the test)
against one small real run made once for the module: clean -> tokenize -> shard -> train.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard
from click.testing import CliRunner

from codex.cli.main import cli
from codex.core.config import build_config
from codex.train.plan.hardware import get_preset
from codex.train.plan.memory import Setting, plan
from tests.test_clean import prose
from tests.test_pipeline import _corpus
from tests.train_helpers import TINY_MODEL

TRAIN = [f"--set={o}" for o in TINY_MODEL] + [
    "--set=train.hardware=cpu",
    "--set=train.wandb=off",
    "--set=train.compile=false",
    "--set=train.warmup_steps=1",
    "--set=train.log_every=1",
    "--set=train.eval_every=0",
    "--device-batch=2",
    "--seq-len=16",
]


def invoke(args: list[str], code: int, *patterns: str) -> str:
    """Run `codex args`; assert the exit code, that each pattern is in the one-line error, no
    traceback."""
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    out = res.output
    assert res.exit_code == code, f"exit {res.exit_code}, wanted {code}:\n{out}"
    assert "Traceback" not in out
    if code:
        errors = [line for line in out.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, out
        assert out.rstrip().splitlines()[-1] == errors[0], f"the error is not one line:\n{out}"
        for p in patterns:
            assert p in errors[0], f"{p!r} not in: {errors[0]}"
    return out


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A finished run: cleaned code corpus, a 300-token tokenizer, shards, a 3-step checkpoint."""
    root = tmp_path_factory.mktemp("bad_input")
    _corpus(root / "src")
    run = root / "run"
    r = ["--run", str(run)]
    invoke(
        [
            "data",
            "clean",
            *r,
            "--input",
            str(root / "src"),
            "--preset",
            "code",
            "--set",
            "data.clean.text_extensions=[.py]",
        ],
        0,
    )
    invoke(["data", "tokenize", *r, "--vocab-size", "300"], 0)
    invoke(["data", "shard", *r, "--val-fraction", "0.1"], 0)
    invoke(["train", *r, *TRAIN, "--max-steps", "3"], 0)
    return run


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    """A private copy of the finished run (cases may damage it)."""
    dst = tmp_path / "run"
    shutil.copytree(base_run, dst)
    return dst


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but RUN/logs/ (each invocation appends its header line there)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).parts[0] != "logs"
    }


# --- clean ----------------------------------------------------------------------------------------


def test_a_txt_file_over_max_chars_fails_naming_the_rule_and_the_delimiter_option(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(prose(i) for i in range(6)))
    small = "--set=data.clean.length.max_chars=2000"  # stands in for the 1 MB default
    invoke(
        ["data", "clean", "--run", str(tmp_path / "r1"), "--input", str(book), small],
        1,
        "kept no documents",
        "length:too_long",
        "--txt-delimiter",
    )
    assert (
        not (tmp_path / "r1" / "clean" / "stats.json").exists()
        or json.loads((tmp_path / "r1" / "clean" / "stats.json").read_text())["docs_out"] == 0
    )
    invoke(
        [
            "data",
            "clean",
            "--run",
            str(tmp_path / "r2"),
            "--input",
            str(book),
            small,
            "--txt-delimiter",
            r"\n\n",
        ],
        0,
    )
    assert json.loads((tmp_path / "r2" / "clean" / "stats.json").read_text())["docs_out"] == 6


def test_a_delimiter_of_real_newlines_is_kept():
    cfg = build_config(overrides=["data.clean.txt_delimiter=\n\n"])
    assert cfg.data.clean.txt_delimiter == "\n\n"


def test_a_rule_that_drops_most_documents_is_named_with_its_switch(tmp_path, caplog):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (src / f"good{i}.txt").write_text(prose(i))
    for i in range(5):
        (src / f"short{i}.txt").write_text(f"just a few words, number {i}.")
    with caplog.at_level(logging.WARNING):
        invoke(["data", "clean", "--run", str(tmp_path / "r"), "--input", str(src)], 0)
    assert "gopher_quality:short_doc dropped 5 of 7 documents" in caplog.text
    assert "--set data.clean.gopher_quality.enabled=false" in caplog.text


def _zst_lines(n: int, start: int = 0) -> bytes:
    return zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": prose(i)}) + "\n" for i in range(start, start + n)).encode()
    )


@pytest.mark.parametrize(
    "damage, pattern", [("random", "not a valid zstd stream"), ("truncated", "truncated")]
)
def test_a_damaged_zst_fails_alone_and_later_stages_refuse_the_partial_corpus(
    tmp_path, damage, pattern, caplog
):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl.zst").write_bytes(_zst_lines(4))
    whole = _zst_lines(30, start=4)
    (src / "g.jsonl.zst").write_bytes(
        np.random.default_rng(0).bytes(5000) if damage == "random" else whole[: len(whole) // 2]
    )
    run = str(tmp_path / "r")
    with caplog.at_level(logging.WARNING):
        invoke(
            ["data", "clean", "--run", run, "--input", str(src)],
            1,
            "1 input file(s) failed",
            "g.jsonl.zst",
            pattern,
        )
    # no stray ", "
    assert "clean: bad input (details in stats.json): 1 failed files" in caplog.text
    stats = json.loads((tmp_path / "r" / "clean" / "stats.json").read_text())
    assert stats["docs_out"] == 4  # the good file was cleaned
    assert [f["path"] for f in stats["bad_input"]["failed_files"]] == [str(src / "g.jsonl.zst")]
    invoke(["data", "tokenize", "--run", run], 1, "clean did not finish", "g.jsonl.zst")
    # a tokenizer from the files given
    invoke(
        [
            "data",
            "tokenize",
            "--run",
            run,
            "--input",
            str(tmp_path / "r" / "clean" / "part-*.parquet"),
            "--vocab-size",
            "300",
        ],
        0,
    )
    invoke(["data", "shard", "--run", run], 1, "clean did not finish", "g.jsonl.zst")
    assert not (tmp_path / "r" / "shards" / "manifest.json").exists()


def test_jsonl_without_the_text_field_says_which_field(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text("".join(json.dumps({"body": prose(i)}) + "\n" for i in range(3)))
    invoke(
        ["data", "clean", "--run", str(tmp_path / "r"), "--input", str(f)],
        1,
        "no document was read",
        "no field 'text'",
        "--text-field",
    )


@pytest.mark.parametrize(
    "args, code, pattern",
    [
        (["--input", "/nonexistent/in.jsonl"], 2, "/nonexistent/in.jsonl: no such file"),
        (["--input", "{tmp}/x.bin"], 2, "unsupported file type"),
        (["--input", "{tmp}/p.parquet"], 1, "no column 'text'"),
        (["--input", "{tmp}/p.parquet", "--workers", "-1"], 2, "data.clean.workers=-1"),
        (
            ["--input", "{tmp}/p.parquet", "--num-tasks", "2", "--task-index", "3"],
            2,
            "task_index=3",
        ),
        (
            ["--input", "{tmp}/p.parquet", "--set", "data.clean.preset=prose"],
            2,
            "data.clean.preset",
        ),
    ],
)
def test_clean_usage_and_unusable_files(tmp_path, args, code, pattern):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "x.bin").write_bytes(b"\0")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "p.parquet")
    invoke(
        ["data", "clean", "--run", str(tmp_path / "r"), *[a.format(tmp=tmp_path) for a in args]],
        code,
        pattern,
    )


# --- tokenize / shard / verify --------------------------------------------------------------------


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


# --- train ---------------------------------------------------------------------------------------


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


# --- eval / sample -------------------------------------------------------------------------------


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


def test_debug_env_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("CODEX_DEBUG", "1")
    with pytest.raises(Exception, match="train.lr"):
        CliRunner().invoke(cli, ["train", "--set", "train.lr=-1"], catch_exceptions=False)
    assert os.environ["CODEX_DEBUG"] == "1"


# --- train against its data ----------------------------------------------------------------------


def test_train_refuses_a_damaged_shard_the_first_time_it_opens_it(run):
    shard = run / "shards" / "train_00000.npy"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: still a valid .npy of the right shape
    shard.write_bytes(bytes(data))
    invoke(["train", "--run", str(run), *TRAIN, "--max-steps", "5"], 1, "train_00000.npy", "sha256")


def _retokenized(run: Path, sha: str) -> None:
    """As if `codex data tokenize` had made another tokenizer (its meta's sha256)."""
    meta_path = run / "tokenizer" / "tokenizer_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["sha256"] = sha
    meta_path.write_text(json.dumps(meta))


def test_train_refuses_shards_made_with_another_tokenizer(run):
    _retokenized(run, "e" * 64)
    invoke(
        ["train", "--run", str(run), *TRAIN, "--max-steps", "5"],
        1,
        "manifest.json",
        "another tokenizer",
    )


def test_train_refuses_to_resume_under_another_tokenizer(run):
    _retokenized(run, "e" * 64)
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


def test_a_damaged_only_checkpoint_is_bad_data_for_eval_sample_and_export(run, tmp_path):
    """Exit 1 (bad data), as README promises, not 2 (a usage mistake)."""
    (step,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    for f in step.rglob("*.distcp"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated
    for cmd in (
        ["eval"],
        ["sample", "--prompt", "def"],
        ["export", "--format", "torch", "--out", str(tmp_path / "m.pt")],
    ):
        invoke([*cmd, "--run", str(run)], 1, "no intact checkpoint", "damaged")


@pytest.mark.gcs
def test_a_run_in_a_missing_bucket_names_the_bucket(tmp_path, gcs_emulator):
    text = tmp_path / "a.txt"
    text.write_text(prose(1))
    run = "gs://no-such-bucket-codex/run"
    for args in (
        ["data", "clean", "--input", str(text)],
        ["data", "tokenize"],
        ["eval"],
        ["train", *TRAIN],
    ):
        invoke([*args, "--run", run], 2, "gs://no-such-bucket-codex: no such bucket")


class _Payload:
    """What a forged pickle carries: a call to run on load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_forged_checkpoint_index_runs_nothing(run, tmp_path):
    """A .metadata whose pickle calls os.system (DONE's checksums forged to match): eval, sample
    and a resumed train refuse it with one line, exit 1, and the call never happens."""
    import hashlib
    import pickle

    marker = tmp_path / "pwned"
    (step,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    data = pickle.dumps(_Payload(marker))
    (step / ".metadata").write_bytes(data)
    done = json.loads((step / "DONE").read_text())
    done["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "DONE").write_text(json.dumps(done))
    for cmd in (["eval"], ["sample", "--prompt", "def"], ["train", *TRAIN, "--max-steps", "5"]):
        invoke([*cmd, "--run", str(run)], 1, ".metadata", "posix.system", "refusing to load")
    assert not marker.exists()


def test_a_full_disk_is_one_line_and_a_rerun_keeps_the_finished_work(tmp_path, monkeypatch):
    import errno

    from codex.core import fsio

    src = tmp_path / "in.txt"
    src.write_text(prose(3))
    real = fsio.write_json

    def full(path, obj, *a, **k):  # the disk fills up as the stage commits
        if str(path).endswith("stats.json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, obj, *a, **k)

    monkeypatch.setattr(fsio, "write_json", full)
    run = tmp_path / "run"
    out = invoke(["data", "clean", "--run", str(run), "--input", str(src)], 1, "stats.json")
    assert "no space left on the device" in out and "MB free on its disk" in out
    assert list((run / "clean" / "markers").glob("*.json"))  # the finished unit is kept
    monkeypatch.setattr(fsio, "write_json", real)
    invoke(["data", "clean", "--run", str(run), "--input", str(src)], 0)
    assert (run / "clean" / "stats.json").exists()


# --- clean: hostile input files, low yield, delimiters, sources -----------------------------------


def _clean(run: Path, *args: str) -> list[str]:
    return ["data", "clean", "--run", str(run), *args]


def _stats(run: Path) -> dict:
    return json.loads((run / "clean" / "stats.json").read_text())


def _kept(run: Path) -> list[dict]:
    """The cleaned documents: {"text", "source", ...} per row of every part."""
    import pyarrow.parquet as pq

    rows: list[dict] = []
    for part in sorted((run / "clean").glob("part-*.parquet")):
        rows += pq.read_table(part).to_pylist()
    return rows


def _warnings(caplog, *needles: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and all(n in r.getMessage() for n in needles)
    ]


def test_an_empty_input_file_keeps_nothing_and_is_named(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    run = tmp_path / "r"
    invoke(_clean(run, "--input", str(f)), 1, "kept no documents", "empty.txt")
    invoke(["data", "tokenize", "--run", str(run)], 1, "kept no documents")
    assert not (run / "tokenizer").exists()


def test_a_binary_file_named_txt_is_reported_and_kept_out(tmp_path, caplog):
    src = tmp_path / "in"
    src.mkdir()
    (src / "good.txt").write_text(prose(1))
    (src / "blob.txt").write_bytes(np.random.default_rng(0).bytes(3000))
    run = tmp_path / "r"
    with caplog.at_level(logging.WARNING):
        invoke(_clean(run, "--input", str(src)), 0)
    assert _warnings(caplog, str(src / "blob.txt"), "invalid UTF-8")
    assert {r["source"] for r in _kept(run)} == {str(src / "good.txt")}


def test_non_utf8_bytes_in_a_jsonl_line_are_counted_and_named(tmp_path, caplog):
    f = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": prose(i)}).encode() for i in range(3)]
    lines[1] = lines[1].replace(b"valley", b"vall\xff\xfeey", 1)
    f.write_bytes(b"\n".join(lines) + b"\n")
    run = tmp_path / "r"
    with caplog.at_level(logging.WARNING):
        invoke(_clean(run, "--input", str(f)), 0)
    bad = _stats(run)["bad_input"]["invalid_utf8_records"]
    assert bad["count"] == 1 and bad["first_files"] == [str(f)]
    assert _warnings(caplog, str(f), "invalid UTF-8 in 1 records")
    assert len(_kept(run)) == 3  # the line is kept, its two bytes replaced


def test_a_jsonl_line_that_is_an_array_is_skipped_and_named(tmp_path, caplog):
    f = tmp_path / "docs.jsonl"
    good = [json.dumps({"text": prose(i)}) for i in range(3)]
    f.write_text("\n".join([good[0], json.dumps([prose(9)]), *good[1:]]) + "\n")
    run = tmp_path / "r"
    with caplog.at_level(logging.WARNING):
        invoke(_clean(run, "--input", str(f)), 0)
    stats = _stats(run)
    assert stats["docs_out"] == 3
    assert stats["bad_input"]["malformed_lines"]["first"] == [
        {"path": str(f), "lines": ["line 2: not an object"]}
    ]
    assert _warnings(caplog, str(f), "line 2: not an object")
    # a file of arrays only: nothing was read, and the line (and its file) is named
    g = tmp_path / "arrays.jsonl"
    g.write_text(json.dumps([prose(1)]) + "\n")
    invoke(
        _clean(tmp_path / "r2", "--input", str(g)),
        1,
        "no document was read",
        "arrays.jsonl",
        "line 1: not an object",
    )


def test_a_truncated_parquet_input_fails_alone_naming_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "in"
    src.mkdir()
    (src / "good.txt").write_text(prose(1))
    p = src / "cut.parquet"
    pq.write_table(pa.table({"text": [prose(i) for i in range(2, 8)]}), p)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    run = tmp_path / "r"
    invoke(_clean(run, "--input", str(src)), 1, "1 input file(s) failed", str(p))
    assert {r["source"] for r in _kept(run)} == {str(src / "good.txt")}
    invoke(["data", "tokenize", "--run", str(run)], 1, "clean did not finish", str(p))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_an_unreadable_input_file_fails_alone_naming_it(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "good.txt").write_text(prose(1))
    locked = src / "locked.txt"
    locked.write_text(prose(2))
    locked.chmod(0)
    try:
        invoke(
            _clean(tmp_path / "r", "--input", str(src)),
            1,
            "1 input file(s) failed",
            str(locked),
            "Permission denied",
        )
    finally:
        locked.chmod(0o644)
    assert {r["source"] for r in _kept(tmp_path / "r")} == {str(src / "good.txt")}


def test_a_whole_file_dropped_by_a_length_rule_is_named_with_its_switch(tmp_path, caplog):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        (src / f"small{i}.txt").write_text(prose(i))
    big = src / "big.txt"
    big.write_text("\n\n".join(prose(i) for i in range(10, 16)))  # over the 2000 below
    run = tmp_path / "r"
    with caplog.at_level(logging.WARNING):
        invoke(_clean(run, "--input", str(src), "--set=data.clean.length.max_chars=2000"), 0)
    (warned,) = _warnings(caplog, "dropped whole")
    assert str(big) in warned and "--txt-delimiter blank-lines" in warned
    assert "small0.txt" not in warned
    whole = _stats(run)["bad_input"]["whole_files_dropped"]
    assert whole == [{"path": str(big), "reason": "length:too_long"}]


def test_a_low_yield_clean_exits_1_until_allow_low_yield(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "small.txt").write_text(prose(1))
    (src / "book.txt").write_text("\n\n".join(prose(i) for i in range(2, 202)))  # ~125 kB
    run = tmp_path / "r"
    args = _clean(run, "--input", str(src), "--set=data.clean.length.max_chars=2000")
    invoke(args, 1, "clean kept 0.", "min_yield=0.01", "length:too_long", "--allow-low-yield")
    invoke(["data", "tokenize", "--run", str(run)], 1, "--allow-low-yield")
    assert not (run / "tokenizer").exists()
    markers = files_under(run / "clean" / "markers")
    invoke([*args, "--allow-low-yield"], 0)
    assert "low_yield" not in _stats(run) and _stats(run)["docs_out"] == 1
    assert files_under(run / "clean" / "markers") == markers  # nothing was cleaned again


def test_blank_lines_holding_white_space_split_documents(tmp_path):
    paras = [prose(i).replace("\n", " ") for i in range(4)]
    f = tmp_path / "wiki.txt"
    # separators: a line of spaces, a tab line then a space line, a CRLF blank line; blank lines
    # at both ends. Not one of them is the two characters '\n\n'.
    f.write_bytes(
        (
            "  \n"
            + paras[0]
            + "\n \n"
            + paras[1]
            + "\n\t\n   \n"
            + paras[2]
            + "\r\n\r\n"
            + paras[3]
            + "\n  \n"
        ).encode()
    )
    invoke(_clean(tmp_path / "b", "--input", str(f), "--txt-delimiter", "blank-lines"), 0)
    assert sorted(r["text"].strip() for r in _kept(tmp_path / "b")) == sorted(paras)
    quality = [f"--set=data.clean.{f}.enabled=false" for f in ("gopher_repetition", "fineweb")]
    invoke(
        _clean(
            tmp_path / "n",
            "--input",
            str(f),
            "--txt-delimiter",
            r"\n\n",
            "--set=data.clean.length.max_chars=3000",
            *quality,
        ),
        0,
    )
    assert _stats(tmp_path / "n")["docs_in"] == 1  # '\n\n' never matched: one document


@pytest.mark.parametrize(
    "content, code, patterns",
    [
        (None, 2, ["sources.yaml", "No such file"]),
        ("- {input: a.txt\n", 2, ["sources.yaml line 2", "invalid YAML"]),
        ("input: a.txt\n", 2, ["sources.yaml", "want a YAML list"]),
        (
            "- {input: '{src}', presets: code}\n",
            2,
            ["data.clean.sources[0]: unknown key 'presets'"],
        ),
        ("- {input: '{src}', preset: prose}\n", 2, ["data.clean.sources[0].preset: 'prose'"]),
        ("- {preset: code}\n", 2, ["data.clean.sources[0]: needs 'input: PATH'"]),
        ("- {input: '{src}'}\n- {input: '{tmp}/gone.txt'}\n", 2, ["gone.txt: no such file"]),
    ],
)
def test_a_sources_file_with_bad_content_is_a_usage_error_naming_it(
    tmp_path, content, code, patterns
):
    src = tmp_path / "src.txt"
    src.write_text(prose(1))
    sources = tmp_path / "sources.yaml"
    if content is not None:
        sources.write_text(content.replace("{src}", str(src)).replace("{tmp}", str(tmp_path)))
    run = tmp_path / "r"
    invoke(_clean(run, "--sources", str(sources)), code, *patterns)
    assert not run.exists()  # refused before anything was written


def test_a_rerun_of_clean_removes_the_temp_files_a_killed_run_left(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        (src / f"d{i}.txt").write_text(prose(i))
    run = tmp_path / "r"
    invoke(_clean(run, "--input", str(src)), 0)
    clean = run / "clean"
    parts = {p.name: p.read_bytes() for p in clean.glob("part-*.parquet")}
    debris = [
        clean / ".tmp-part-000000-000.parquet.k1x2",  # what kill -9 during a part write leaves
        clean / ".tmp-stats.json.q9",
        clean / "markers" / ".tmp-000000.json.zz",
        clean / "hashes" / ".tmp-000000.npy.a8",
    ]
    for d in debris:
        d.parent.mkdir(exist_ok=True)
        d.write_bytes(b"partial")
    invoke(_clean(run, "--input", str(src)), 0)
    assert [d.name for d in debris if d.exists()] == []
    assert parts and {p.name: p.read_bytes() for p in clean.glob("part-*.parquet")} == parts


@pytest.mark.parametrize("command", [["data", "clean", "--input", "{src}"], ["train", *TRAIN]])
def test_a_run_directory_that_is_a_file_is_named(tmp_path, command):
    src = tmp_path / "a.txt"
    src.write_text(prose(1))
    run = tmp_path / "run"
    run.write_text("not a folder")
    args = [a.replace("{src}", str(src)) for a in command]
    invoke([*args, "--run", str(run)], 2, str(run), "not a directory")
    assert run.read_text() == "not a folder"


# --- tokenize / shard / verify against damaged files ---------------------------------------------


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


def test_a_truncated_tokenizer_json_is_one_line_naming_it(run):
    tok = run / "tokenizer" / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[: tok.stat().st_size // 2])
    invoke(["sample", "--run", str(run), "--prompt", "def"], 1, str(tok), "does not match")
    out = invoke(["data", "verify", str(run)], 1, "1 problem(s)")
    assert "tokenizer.json has sha256" in out


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


def test_a_tokenizer_meta_that_is_not_an_object_is_one_line(run):
    meta = run / "tokenizer" / "tokenizer_meta.json"
    meta.write_text("[300]")
    for cmd in (["train", *TRAIN, "--max-steps", "5"], ["sample", "--prompt", "def"]):
        invoke([*cmd, "--run", str(run)], 1, str(meta), "JSON object")


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


def test_eval_refuses_a_damaged_validation_shard(run):
    shard = run / "shards" / "val_00000.npy"
    data = bytearray(shard.read_bytes())
    data[-4] ^= 0x01  # the low byte of the next-to-last token: another valid id, a valid .npy
    shard.write_bytes(bytes(data))
    invoke(["eval", "--run", str(run)], 1, "val_00000.npy", "sha256")
    assert not list((run / "eval").glob("step_*.json"))


# --- train: shapes and data that do not match the run ---------------------------------------------


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
    (changed,) = _warnings(caplog, "resuming with")
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


@pytest.mark.parametrize("damage", ["sha256", "not-json", "a-list"])
def test_a_checkpoint_whose_done_does_not_vouch_for_it(run, tmp_path, damage):
    """Eval, export and train all refuse it (exit 1); train does not start over from step 0."""
    (step,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    done_path = step / "DONE"
    if damage == "sha256":
        done = json.loads(done_path.read_text())
        name = sorted(n for n in done["files"] if n.endswith(".distcp"))[0]
        done["files"][name]["sha256"] = "0" * 64
        done_path.write_text(json.dumps(done))
    elif damage == "not-json":
        done_path.write_text(done_path.read_text()[:20])
    else:
        done_path.write_text("[]")
    before = files_under(run / "checkpoints")
    out = tmp_path / "m.pt"
    for cmd in (
        ["eval"],
        ["export", "--format", "torch", "--out", str(out)],
        ["train", *TRAIN, "--max-steps", "5"],
    ):
        invoke([*cmd, "--run", str(run)], 1, "no intact checkpoint", str(step))
    assert files_under(run / "checkpoints") == before
    assert not out.exists()


def _pickle_calling(module: str, name: str, args: tuple) -> bytes:
    """A protocol-4 pickle that calls module's attribute `name` (a dotted path) with `args`: what
    pickle.dumps would write for a class reached through other modules' attributes."""

    def text(s: str) -> bytes:
        b = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b

    call_args = pickle.dumps(args, protocol=2)[2:-1]  # without PROTO and STOP
    return (
        pickle.PROTO
        + bytes([4])
        + text(module)
        + text(name)
        + pickle.STACK_GLOBAL
        + call_args
        + pickle.REDUCE
        + pickle.STOP
    )


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed.checkpoint.filesystem", "io.FileIO"),  # creates or truncates a file
        (
            "torch.distributed.checkpoint.metadata",
            "torch._strobelight.cli_function_profiler.subprocess.Popen",  # runs a command
        ),
    ],
)
def test_a_forged_index_reaching_a_class_through_a_module_attribute_runs_nothing(
    run, tmp_path, module, name
):
    """DCP's own modules are allowed, but a dotted name walks from them to any class they can
    reach (io.FileIO, subprocess.Popen): the index must be refused before the call."""
    import functools
    import hashlib
    import importlib
    import time

    def payload(marker: Path) -> bytes:
        args = (str(marker), "w") if name.endswith("FileIO") else (["touch", str(marker)],)
        return _pickle_calling(module, name, args)

    # the forgery is live: plain pickle runs it
    target = functools.reduce(getattr, name.split("."), importlib.import_module(module))
    assert isinstance(target, type)
    probe = tmp_path / "probe"
    obj = pickle.loads(payload(probe))
    (obj.wait if hasattr(obj, "wait") else obj.close)()  # the process ended, or the file closed
    assert probe.exists()

    marker = tmp_path / "pwned"
    (step,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    data = payload(marker)
    (step / ".metadata").write_bytes(data)
    done = json.loads((step / "DONE").read_text())
    done["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "DONE").write_text(json.dumps(done))
    for cmd in (
        ["eval"],
        ["sample", "--prompt", "def"],
        ["export", "--format", "torch", "--out", str(tmp_path / "m.pt")],
        ["train", *TRAIN, "--max-steps", "5"],
    ):
        invoke([*cmd, "--run", str(run)], 1, ".metadata", "refusing to load")
    time.sleep(0.5)  # a started process would have touched it by now
    assert not marker.exists()


def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_loses_nothing(run, monkeypatch):
    """ENOSPC inside DCP's tensor write (torch.save under it turns it into a RuntimeError, and DCP
    wraps that in a CheckpointException): one line naming the file, exit 1; the last checkpoint
    stays, and a rerun resumes from it."""
    import errno

    from fsspec.implementations.local import LocalFileSystem

    class Full:
        """A file on a disk with no space left: every write fails."""

        def __init__(self, f):
            self.f = f

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    real_open = LocalFileSystem._open

    def full_open(self, path, mode="rb", *args, **kwargs):
        f = real_open(self, path, mode, *args, **kwargs)
        return Full(f) if "step_00000005" in str(path) and "w" in mode else f

    monkeypatch.setattr(LocalFileSystem, "_open", full_open)
    out = invoke(["train", "--run", str(run), *TRAIN, "--max-steps", "5"], 1, "step_00000005")
    assert "no space left on the device" in out and "MB free on its disk" in out
    ckpts = run / "checkpoints"
    assert (ckpts / "step_00000003" / "DONE").exists()
    assert not (ckpts / "step_00000005" / "DONE").exists()
    monkeypatch.undo()
    invoke(["train", "--run", str(run), *TRAIN, "--max-steps", "5"], 0)
    assert (ckpts / "step_00000005" / "DONE").exists()


# --- upload, export, downstream tasks -------------------------------------------------------------


def test_upload_onto_another_run_is_refused_unless_overwrite(run, tmp_path):
    target = tmp_path / "target"
    invoke(["data", "upload", str(run), str(target)], 0)
    other = tmp_path / "other"
    shutil.copytree(run, other)
    _retokenized(other, "e" * 64)  # run B: another tokenizer
    before = files_under(target)
    invoke(
        ["data", "upload", str(other), str(target)],
        2,
        "holds another run",
        "tokenizer/tokenizer_meta.json",
        "--overwrite",
    )
    assert files_under(target) == before  # nothing of B was copied onto A
    stale = target / "checkpoints" / "step_00000099"  # something of A's that B does not have
    stale.mkdir()
    (stale / "DONE").write_text("{}")
    invoke(["data", "upload", str(other), str(target), "--overwrite"], 0)
    assert not (stale / "DONE").exists()
    assert files_under(target) == files_under(other)


def test_upload_of_another_model_on_the_same_data_is_refused(run, tmp_path):
    """Run B trains another model on run A's data: the same stats, tokenizer and manifest, but the
    target would end up holding A's checkpoints beside B's. The same run resumed with more steps
    (its model unchanged) uploads onto its own copy."""
    import yaml

    target = tmp_path / "target"
    invoke(["data", "upload", str(run), str(target)], 0)

    def with_config(name: str, section: str, key: str, value) -> Path:
        other = tmp_path / name
        shutil.copytree(run, other)
        path = other / "checkpoints" / "config.yaml"
        cfg = yaml.safe_load(path.read_text())
        cfg[section][key] = value
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return other

    wider = with_config("wider", "model", "n_embd", 2 * yaml.safe_load(
        (run / "checkpoints" / "config.yaml").read_text())["model"]["n_embd"])  # fmt: skip
    before = files_under(target)
    invoke(
        ["data", "upload", str(wider), str(target)],
        2,
        "holds another run",
        "checkpoints/config.yaml trains another model (model.n_embd)",
    )
    assert files_under(target) == before
    longer = with_config("longer", "train", "max_steps", 10_000)
    invoke(["data", "upload", str(longer), str(target)], 0)


@pytest.mark.gcs
def test_upload_onto_another_gs_run_is_refused_unless_overwrite(run, tmp_path, gcs_bucket):
    from codex.core import fsio

    target = f"{gcs_bucket}/run"
    invoke(["data", "upload", str(run), target], 0)
    other = tmp_path / "other"
    shutil.copytree(run, other)
    _retokenized(other, "e" * 64)
    remote_meta = f"{target}/tokenizer/tokenizer_meta.json"
    invoke(["data", "upload", str(other), target], 2, "holds another run", "--overwrite")
    assert fsio.read_bytes(remote_meta) == (run / "tokenizer" / "tokenizer_meta.json").read_bytes()
    invoke(["data", "upload", str(other), target, "--overwrite"], 0)
    assert (
        fsio.read_bytes(remote_meta) == (other / "tokenizer" / "tokenizer_meta.json").read_bytes()
    )


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


# --- orphans -------------------------------------------------------------------------------------


@pytest.mark.parametrize("armed", [True, False])
def test_a_rank_dies_with_its_killed_launcher(tmp_path, armed):
    """A SIGKILL of the torchrun agent alone: a rank that armed die_with_launcher (as every rank
    torchrun starts does) gets SIGTERM and exits instead of training on, holding the run lock;
    the unarmed control shows the kill alone would leave it running."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "rank.pid"
    arm = (
        "from codex.train.distributed.process_env import die_with_launcher; die_with_launcher(); "
        if armed
        else ""
    )
    rank = f"import os, time; {arm}open({str(pid_file)!r}, 'w').write(str(os.getpid()))"
    rank += "; time.sleep(120)"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {rank!r}]).wait()",
        ],
        cwd=str(Path(__file__).resolve().parent.parent),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (pid_file.exists() and pid_file.read_text()):
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    agent.kill()
    agent.wait()

    def running() -> bool:  # not gone, not a zombie
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + (20 if armed else 2)
    while time.time() < deadline and running():
        time.sleep(0.05)
    alive = running()
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert alive is not armed
