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
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard
from click.testing import CliRunner

from codex.cli.main import cli
from codex.config import build_config
from tests.test_clean import prose
from tests.test_pipeline import _corpus
from tests.train_helpers import TINY_MODEL
from train.plan.hardware import get_preset
from train.plan.memory import plan

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
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
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
        (["--input", "{tmp}/p.parquet", "--workers", "0"], 2, "data.clean.workers=0"),
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
    ],
)
def test_train_config_mistakes_exit_2_before_any_run_file_is_read(tmp_path, extra, pattern):
    # The run directory does not exist: a check that came after reading it would say so instead.
    invoke(["train", "--run", str(tmp_path / "no-such-run"), *TRAIN, *extra], 2, pattern)


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
    assert plan(m, get_preset("cpu"), 2000, 256, dtype="fp32").total > 100e9


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

    from codex import fsio

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
