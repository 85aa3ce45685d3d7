"""Multi-host TPU presets (configs/hardware/*.yaml) and the shared-run-directory rule.

Chips and hosts are Cloud TPU's published slice shapes: v4 and v5p names count TensorCores
(2 per chip), v5e (v5litepod) and v6e names count chips; a multi-host slice has 4 chips per TPU VM
and one codex process per VM. Per-chip bf16 peak and HBM: v4 275 / 32, v5p 459 / 95, v5e 197 / 16,
v6e 918 / 32. No torch_xla needed: the refusal comes before the XLA import.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

import pytest
from click.testing import CliRunner

from codex.cli.main import cli
from codex.core.config import ConfigError, build_config
from codex.train.plan.presets import get_preset
from codex.train.plan.report import format_hardware_table
from codex.train.plan.world import require_shared_run_dir

# name -> (chips, hosts, family, per-chip bf16 TFLOP/s, HBM GB per chip)
MULTI_HOST = {
    "v4-16": (8, 2, "v4", 275, 32),
    "v4-32": (16, 4, "v4", 275, 32),
    "v5p-16": (8, 2, "v5p", 459, 95),
    "v5p-32": (16, 4, "v5p", 459, 95),
    "v5p-64": (32, 8, "v5p", 459, 95),
    "v5litepod-16": (16, 4, "v5e", 197, 16),
    "v5litepod-32": (32, 8, "v5e", 197, 16),
    "v6e-16": (16, 4, "v6e", 918, 32),
    "v6e-32": (32, 8, "v6e", 918, 32),
    "v6e-64": (64, 16, "v6e", 918, 32),
    "v6e-128": (128, 32, "v6e", 918, 32),
    "v6e-256": (256, 64, "v6e", 918, 32),
}


@pytest.mark.parametrize("name", sorted(MULTI_HOST))
def test_multi_host_preset_has_the_slice_shape(name):
    chips, hosts, family, peak, hbm = MULTI_HOST[name]
    p = get_preset(name)
    assert (p.kind, p.family, p.devices, p.hosts, p.devices_per_host) == (
        "tpu",
        family,
        chips,
        hosts,
        4,
    )
    assert (p.peak_flops, p.memory_gb) == (peak * 1e12, hbm)
    counted = int(name.rsplit("-", 1)[1])
    # the naming rule, both ways
    assert counted == (2 * chips if family in ("v4", "v5p") else chips)
    # a single-host preset of the same family fits the same model shapes per chip (data parallel)
    single = {"v4": "v4-8", "v5p": "v5p-8", "v5e": "v5litepod-4", "v6e": "v6e-4"}[family]
    assert p.defaults == get_preset(single).defaults


def test_single_host_presets_stay_single_host_and_the_table_lists_every_slice():
    for name in (
        "v4-8",
        "v5p-8",
        "v5litepod-1",
        "v5litepod-4",
        "v5litepod-8",
        "v6e-1",
        "v6e-4",
        "v6e-8",
    ):
        assert get_preset(name).hosts == 1, name
    table = format_hardware_table()
    for name, (_chips, hosts, *_rest) in MULTI_HOST.items():
        row = next(line for line in table.splitlines() if line.startswith(name + " "))
        assert row.split()[:2] == [name, "tpu"] and f" {hosts} " in row and " 4 " in row


def test_a_multi_host_preset_refuses_a_local_run_directory(tmp_path):
    run = tmp_path / "run"
    res = CliRunner().invoke(
        cli, ["train", "--run", str(run), "--hardware", "v5p-16"], catch_exceptions=False
    )
    assert res.exit_code == 2, res.output
    err = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert (
        len(err) == 1
        and "2 hosts" in err[0]
        and "gs://" in err[0]
        and "train.shared_run_dir=true" in err[0]
    )
    assert not run.exists()  # refused before the run lock or anything else touched it


def test_shared_or_remote_run_directories_and_single_host_presets_pass(tmp_path):
    local = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="local path"):
        require_shared_run_dir(build_config(overrides=["train.hardware=v6e-32"], run=local))
    require_shared_run_dir(build_config(overrides=["train.hardware=v6e-32"], run="gs://bucket/run"))
    require_shared_run_dir(
        build_config(overrides=["train.hardware=v6e-32", "train.shared_run_dir=true"], run=local)
    )
    require_shared_run_dir(build_config(overrides=["train.hardware=v6e-8"], run=local))
    # with the override the CLI goes on to the backend, which names the preset's real requirement
    # instead
    res = CliRunner().invoke(
        cli,
        ["train", "--run", local, "--hardware", "v5p-16", "--set", "train.shared_run_dir=true"],
        catch_exceptions=False,
    )
    assert (
        res.exit_code != 0
        and "shared_run_dir" not in res.output
        and "hardware preset 'v5p-16'" in res.output
    )


def test_the_xla_environment_is_set_before_anything_imports_torch_xla(
    tmp_path, monkeypatch, gcs_bucket
):
    """torch_xla reads XLA_NO_SPECIAL_SCALARS once, at its first import; on a multi-host TPU the
    run lock's worker-id lookup is that first import, before the backend's own."""
    if "torch_xla" in sys.modules:
        pytest.skip("torch_xla is already imported in this process")
    seen = []

    class Spy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch_xla":
                seen.append(os.environ.get("XLA_NO_SPECIAL_SCALARS"))
            return None

    for var in ("XLA_NO_SPECIAL_SCALARS", "RANK", "CLOUD_TPU_TASK_ID", "TPU_WORKER_ID"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setattr(sys, "meta_path", [Spy(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "torch_xla", raising=False)
    CliRunner().invoke(
        cli, ["train", "--run", f"{gcs_bucket}/run", "--hardware", "v5p-16"], catch_exceptions=False
    )
    assert seen and set(seen) == {"1"}  # every import attempt, the first included, saw the setting


def test_docs_hardware_tables_are_what_codex_hardware_prints(monkeypatch):
    """docs/hardware.md's tables are `codex hardware`, `--model 1b`, `--model 7b` and `--model 7b
    --optimizer adamw` as printed now: a change to the plan or a preset that changes them fails
    here until the tables are regenerated. The cpu row's memory is the machine's free RAM: the
    docs' table was printed with 16 GB free."""
    from pathlib import Path

    from codex.train.plan import batch
    from codex.train.plan.report import format_model_fit

    monkeypatch.setattr(batch, "available_bytes", lambda kind, gb: 16_000_000_000)

    doc = (Path(__file__).resolve().parents[3] / "docs" / "hardware.md").read_text()
    blocks = [b.strip("\n") for b in doc.split("```")[1::2]]
    table = format_hardware_table().split("\n\n")[0]
    assert table in blocks
    from codex.core.config.train import TrainConfig

    # `codex hardware --optimizer` defaults to train.optimizer's default
    assert format_model_fit("1b", optimizer=TrainConfig().optimizer) in blocks
    assert format_model_fit("7b", optimizer="adamw") in blocks
    assert format_model_fit("7b", optimizer="muon") in blocks


def test_codex_hardware_shows_the_cpu_memory_trains_plan_is_checked_against(monkeypatch):
    """One source: the cpu row's memory is batch.available_bytes, what `codex train`'s memory plan
    is checked against and logs (memory_lines' "GB per device"), never the preset's 0."""
    from codex.train.plan import batch
    from codex.train.plan.plan import make_plan, planned_vocab
    from codex.train.plan.report import memory_lines

    monkeypatch.setattr(batch, "available_bytes", lambda kind, gb: 12_345_000_000)
    res = CliRunner().invoke(cli, ["hardware"])
    assert res.exit_code == 0, res.output
    (row,) = [line for line in res.output.splitlines() if line.startswith("cpu ")]
    assert row.split()[5:7] == ["12.3", "free"], row
    cfg = build_config(overrides=["train.hardware=cpu"])
    plan = make_plan(cfg, get_preset("cpu"), 1, vocab=planned_vocab(cfg))[1]
    assert "(12.3 GB per device)" in memory_lines(plan.memory)[0]


@pytest.mark.parametrize(
    ("model", "overrides", "world", "tokens", "accum"),
    [
        ("tiny", [], 1, 8192, 8),  # 8 x 128 a micro-batch, the preset's 8,192 a step
        ("tiny", ["train.seq_len=100"], 2, 9600, 6),  # rounded up to whole micro-batches
        ("tiny", ["train.device_batch=16"], 1, 2048, 1),  # a device batch alone: one micro-batch
        ("tiny", ["train.batch_tokens=4096"], 1, 4096, 4),  # given: as given
        (None, [], 1, 8192, 16),  # a custom shape: the preset's 'default' entry, 4 x 128
        ("124m", [], 1, 1024, 1),  # an entry without batch_tokens: one micro-batch
    ],
)
def test_the_cpu_presets_tokens_a_step(model, overrides, world, tokens, accum):
    from tests.fixtures.runs import plan_without_run

    cfg = build_config(model=model, overrides=["train.hardware=cpu", *overrides])
    p = plan_without_run(cfg, get_preset("cpu"), world)
    assert (p.batch_tokens, p.accum) == (tokens, accum)
    assert p.batch_tokens == p.device_batch * p.seq_len * world * p.accum
