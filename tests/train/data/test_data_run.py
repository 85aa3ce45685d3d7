"""Several trainings on one prepared dataset: `codex train --run EXP --data MAIN` reads MAIN's
tokenizer/ and shards/ (train.data_run) and writes only EXP; resume, eval and the refusals follow
the data run recorded in EXP's checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from codex.core.config import build_config
from codex.eval.run import run_eval
from codex.pipeline.shard.manifest import VAL_TOKENS_FLOOR, small_val_split
from tests.fixtures.bad_input import TRAIN, invoke
from tests.fixtures.loader import upload_dir
from tests.fixtures.runs import base_overrides, make_run, one_thread, run_train  # noqa: F401


def _losses(run: str) -> list[tuple]:
    """Every metrics line's kind, step and loss: bitwise, as written."""
    lines = [json.loads(x) for x in Path(run, "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r["step"], r["loss"]) for r in lines if r.get("kind") in ("train", "val")]


@pytest.mark.slow
def test_a_run_on_another_runs_data_trains_bitwise_as_in_that_run(tmp_path):
    main, exp = make_run(tmp_path / "main"), str(tmp_path / "exp")
    before = sorted(p.relative_to(main) for p in Path(main).rglob("*"))
    run_train(main, max_steps=3, eval_every=3)
    run_train(exp, max_steps=3, eval_every=3, data_run=main)
    assert _losses(exp) == _losses(main) and len(_losses(exp)) == 4  # 3 train lines, 1 val
    # nothing copied into exp; nothing of exp's written into main
    assert sorted(p.name for p in Path(exp).iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert {p.relative_to(main).parts[0] for p in Path(main).rglob("*")} - {
        p.parts[0] for p in before
    } == {"checkpoints", "metrics.jsonl"}
    saved = (Path(exp) / "checkpoints" / "config.yaml").read_text()
    assert f"data_run: {main}" in saved  # recorded beside the checkpoints
    # eval finds the val split and tokenizer through the recorded data run
    overrides = base_overrides()
    here, there = (run_eval(build_config(overrides=overrides, run=r)) for r in (main, exp))
    assert there["loss"] == here["loss"] and there["tokens"] == here["tokens"] > 0


@pytest.mark.slow
def test_a_data_run_on_gcs_trains_as_the_local_one(tmp_path, gcs_bucket):
    main, exp = make_run(tmp_path / "main"), str(tmp_path / "exp")
    remote = f"{gcs_bucket}/main"
    for folder in ("tokenizer", "shards"):
        upload_dir(str(Path(main) / folder), f"{remote}/{folder}")
    run_train(main, max_steps=2, eval_every=2)
    run_train(exp, max_steps=2, eval_every=2, data_run=remote)
    assert _losses(exp) == _losses(main) and len(_losses(exp)) == 3


@pytest.mark.slow
def test_a_resume_reads_the_recorded_data_run_and_refuses_another(tmp_path):
    main, other, exp = (str(tmp_path / n) for n in ("main", "other", "exp"))
    make_run(Path(main))
    make_run(Path(other), seed=1)  # the same tokenizer and window count, other text
    steps = ["--max-steps", "3"]
    invoke(["train", "--run", exp, *TRAIN, "--data", main, "--max-steps", "2"], 0)
    invoke(
        ["train", "--run", exp, *TRAIN, "--data", other, *steps],
        2,
        "step 2 was trained on the data of",
        f"resume with --data {main}",
    )
    # without --data: exp has no data of its own, and its checkpoints say whose they trained on
    invoke(["train", "--run", exp, *TRAIN, *steps], 2, "tokenizer", f"resume with --data {main}")
    assert not (Path(exp) / "checkpoints" / "step_00000003").exists()
    # the same data run, written another way, resumes
    invoke(["train", "--run", exp, *TRAIN, "--data", main + "/", *steps], 0)
    assert (Path(exp) / "checkpoints" / "step_00000003").exists()
    # a moved data run: eval says where it looked, and takes the new place by --set
    shutil.move(main, tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=f"{main}/: no such run directory, the data run"):
        run_eval(build_config(overrides=base_overrides(), run=exp))
    moved = base_overrides() + [f"train.data_run={tmp_path / 'moved'}"]
    assert run_eval(build_config(overrides=moved, run=exp))["tokens"] > 0


def _no_tokenizer(data: Path) -> str:
    shutil.rmtree(data / "tokenizer")
    return str(data / "tokenizer" / "tokenizer_meta.json")


def _no_shards(data: Path) -> str:
    (data / "shards" / "manifest.json").unlink()
    return str(data / "shards" / "manifest.json")


def _another_tokenizer(data: Path) -> str:
    meta_path = data / "tokenizer" / "tokenizer_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["sha256"] = "e" * 64  # retrained after the shards were made
    meta_path.write_text(json.dumps(meta))
    return str(data / "shards" / "manifest.json")


@pytest.mark.parametrize(
    ("spoil", "code", "said"),
    [
        (None, 2, "no such run directory"),
        (_no_tokenizer, 2, "not a finished tokenizer"),
        (_no_shards, 2, "no shard manifest"),
        (_another_tokenizer, 1, "shards were made with another tokenizer"),
    ],
)
def test_a_data_run_without_usable_data_is_refused_in_one_line(tmp_path, spoil, code, said):
    data = tmp_path / "main"
    named = str(data)
    if spoil is not None:
        make_run(data)
        named = spoil(data)
    exp = tmp_path / "exp"
    out = invoke(["train", "--run", str(exp), *TRAIN, "--data", str(data)], code, named, said)
    if code == 2:
        assert f"--data {data} (train.data_run)" in out
    assert not (exp / "checkpoints").exists()


def test_a_small_validation_split_is_named_with_the_fraction_that_would_hold_the_floor():
    def note(tokens, fraction=0.005, totals=True):
        m = {"val_fraction": fraction, "totals": {"val": {"tokens": tokens}} if totals else {}}
        return small_val_split(m, "runs/x/shards")

    line = note(6_000)
    assert "runs/x/shards: the validation split holds 6,000 tokens, under 65,536" in line
    assert "for about 66,000, remove runs/x/shards" in line
    assert "--val-fraction 0.055 (now 0.005)" in line
    assert note(VAL_TOKENS_FLOOR) is None and note(6_000, totals=False) is None
    assert "--val-fraction 0.1 (now 0.005)" in note(100)  # no more than a tenth of the corpus
    assert note(30_000, fraction=0.1) is None  # at that tenth: nothing more to suggest
