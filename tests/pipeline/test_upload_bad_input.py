"""`codex data upload` onto a target that holds another run (another tokenizer, another model on
the same data), local and gs://: refused, exit 2, unless --overwrite. Policy: docs/bad-input.md."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.fixtures.bad_input import files_under, invoke, retokenized


def test_upload_onto_another_run_is_refused_unless_overwrite(run, tmp_path):
    target = tmp_path / "target"
    invoke(["data", "upload", str(run), str(target)], 0)
    other = tmp_path / "other"
    shutil.copytree(run, other)
    retokenized(other, "e" * 64)  # run B: another tokenizer
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
    retokenized(other, "e" * 64)
    remote_meta = f"{target}/tokenizer/tokenizer_meta.json"
    invoke(["data", "upload", str(other), target], 2, "holds another run", "--overwrite")
    assert fsio.read_bytes(remote_meta) == (run / "tokenizer" / "tokenizer_meta.json").read_bytes()
    invoke(["data", "upload", str(other), target, "--overwrite"], 0)
    assert (
        fsio.read_bytes(remote_meta) == (other / "tokenizer" / "tokenizer_meta.json").read_bytes()
    )
