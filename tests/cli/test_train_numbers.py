"""The numbers `codex train` gives in three places agree: its --help's plan (the run's tokenizer's
vocab, the parameter count), its log lines, and docs/training.md's account of a CPU log line.
One tiny run trains once for the module."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from codex.cli.main import cli
from tests.fixtures.import_graph import ROOT
from tests.fixtures.runs import VOCAB, make_run, train_cli_args

pytestmark = pytest.mark.slow  # trains in-process (about 2 s)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(`codex train ... --help`'s output, the records `codex train ...` logged) on a run whose
    tokenizer has VOCAB tokens, far from data.tokenizer.vocab_size's default."""
    run = make_run(tmp_path_factory.mktemp("numbers") / "run")
    args = ["train", *train_cli_args(run, max_steps=2)]
    helped = CliRunner().invoke(cli, [*args, "--help"])
    assert helped.exit_code == 0, helped.output
    root, handler = logging.getLogger(), _Records()
    level, threads = root.level, torch.get_num_threads()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    torch.set_num_threads(1)
    try:
        res = CliRunner().invoke(cli, args)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    return helped.output, handler.records


def _train_lines(records, start: str) -> list[str]:
    return [
        r.getMessage()
        for r in records
        if r.name == "codex.train" and r.getMessage().startswith(start)
    ]


def test_train_help_plans_the_runs_tokenizer_and_counts_the_params_training_logs(trained):
    out, records = trained
    plan = " ".join(out.split("Resolved for this command line:")[1].split())
    assert f"vocab_size=0 (the run's tokenizer's: {VOCAB})" in plan, plan
    planned = re.search(r"; ([\d.]+M) parameters", plan)
    assert planned, plan
    (started,) = _train_lines(records, "model ")
    (memory,) = _train_lines(records, "memory plan: ")
    assert started.startswith(f"model {planned.group(1)} params |"), (planned.group(1), started)
    assert memory.startswith(f"memory plan: {planned.group(1)} params on cpu"), memory


def _fields(message: str) -> list[str]:
    """A log line's shape: its ' | ' fields with every number made N."""
    return [re.sub(r"-?\d[\d.e+-]*", "N", f) for f in message.split(" | ")]


def test_a_cpu_log_line_has_the_fields_docs_training_md_says(trained):
    doc = (Path(ROOT) / "docs" / "training.md").read_text()
    (shown,) = [line for line in doc.splitlines() if " codex.train: step " in line]
    steps = _train_lines(trained[1], "step ")
    assert steps, "no step line was logged"
    assert _fields(steps[-1]) == _fields(shown.split("codex.train: ", 1)[1]), (steps[-1], shown)
    assert "MFU" not in steps[-1]  # the cpu preset has no peak: docs/training.md says none
