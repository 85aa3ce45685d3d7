"""`codex eval --tasks`: lm-eval-harness on the exported checkpoint, on a local multiple-choice task
whose accuracy is computed by hand with codex's own model; missing datasets and unknown tasks."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.evaluation import make_eval_run

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Nothing here may reach the network (the hub, datasets)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


QUESTIONS = [
    ("The quick brown fox jumps over the lazy", ["dog", "fox", "sleeps", "vu"]),
    ("def add(a, b):\n    return a", ["+ b", "- b", "lazy", "dog"]),
    ("Grüße aus", ["Köln", "dog", "return", "quick"]),
    ("The quick brown", ["fox", "dog", "add", "café"]),
    ("ünïcödé ✓✓ naïve", ["café", "dog", "brown", "b"]),
    ("the lazy dog", ["sleeps", "jumps", "Köln", "return"]),
]


def write_task(
    folder: Path, name: str, docs: list[dict] | None, dataset_path: str = "json"
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"task: {name}", f"dataset_path: {dataset_path}"]
    if docs is not None:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        lines += ["dataset_kwargs:", "  data_files:", f"    test: {data}"]
    lines += [
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{question}}"',
        'doc_to_choice: "{{choices}}"',
        "doc_to_target: label",
        'target_delimiter: " "',
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
    ]
    (folder / f"{name}.yaml").write_text("\n".join(lines) + "\n")
    return folder


def codex_choice(model, tok, context: str, choices: list[str]) -> int:
    """The choice with the highest summed log-likelihood given <|bos|> + context, computed with
    codex's model and tokenizer as lm-eval splits the pair: the continuation is what encoding the
    whole text adds after the context's tokens."""
    scores = []
    for choice in choices:
        ctx = [0] + tok.encode(context).ids
        whole = [0] + tok.encode(context + " " + choice).ids
        cont = whole[len(ctx) :]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[:, :-1]).float(), dim=-1)[0]
        scores.append(sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont)))
    return max(range(len(choices)), key=lambda i: scores[i])


@pytest.mark.slow
def test_eval_tasks_accuracy_matches_hand_computation(tmp_path):
    from click.testing import CliRunner

    from codex.cli.main import cli

    run, tok, model = make_eval_run(tmp_path, train_steps=30)
    model.eval()
    picks = [codex_choice(model, tok, q, c) for q, c in QUESTIONS]
    # targets: the model's pick for the first four questions, another choice for the last two
    labels = [p if i < 4 else (p + 1) % len(QUESTIONS[i][1]) for i, p in enumerate(picks)]
    expected = sum(p == t for p, t in zip(picks, labels, strict=True)) / len(labels)
    assert expected == pytest.approx(4 / 6)
    docs = [
        {"question": q, "choices": c, "label": t}
        for (q, c), t in zip(QUESTIONS, labels, strict=True)
    ]
    tasks = write_task(tmp_path / "tasks", "codex_local_mc", docs)

    r = CliRunner().invoke(
        cli,
        [
            "eval",
            "--run",
            run,
            "--checkpoint",
            "7",
            "--tasks",
            "codex_local_mc",
            "--tasks-path",
            str(tasks),
            "--limit",
            "100",
        ],
    )
    assert r.exit_code == 0, r.output
    records = list(Path(run, "eval").glob("step_7.tasks-*.json"))
    assert len(records) == 1
    rec = json.loads(records[0].read_text())
    assert rec["tasks"]["codex_local_mc"]["acc"] == pytest.approx(expected, abs=1e-9)
    assert rec["tasks"]["codex_local_mc"]["samples"] == 6
    assert rec["step"] == 7 and rec["limit"] == 100 and rec["lm_eval_version"].startswith("0.4")
    assert "codex_local_mc" in r.output


@pytest.mark.slow
def test_eval_tasks_missing_dataset_and_unknown_task(tmp_path):
    from click.testing import CliRunner

    from codex.cli.main import cli

    run, _, _ = make_eval_run(tmp_path)
    tasks = write_task(
        tmp_path / "tasks", "codex_missing", None, dataset_path="codex-test-org/not-downloaded"
    )
    r = CliRunner().invoke(
        cli, ["eval", "--run", run, "--tasks", "codex_missing", "--tasks-path", str(tasks)]
    )
    assert r.exit_code == 1, r.output
    assert "task codex_missing: its dataset could not be loaded" in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not list(Path(run, "eval").glob("*.tasks-*.json"))

    r = CliRunner().invoke(
        cli, ["eval", "--run", run, "--tasks", "no_such_task_xyz", "--tasks-path", str(tasks)]
    )
    assert r.exit_code == 2, r.output
    assert "no_such_task_xyz" in r.output


def test_an_unreachable_hub_means_offline_at_once(tmp_path, monkeypatch, caplog):
    """Without the offline switches and with the hub unreachable (a blackholed address), codex
    stops waiting after one short probe and goes offline, so a dataset that is not cached fails
    with its one line instead of after a minute of retries."""
    from click.testing import CliRunner

    from codex.cli.main import cli
    from codex.eval import tasks as eval_tasks

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "https://10.255.255.1")  # never answers
    monkeypatch.setattr(eval_tasks, "HUB_PROBE_S", 0.5)
    run, _, _ = make_eval_run(tmp_path)
    tasks = write_task(
        tmp_path / "tasks", "codex_missing", None, dataset_path="codex-test-org/not-downloaded"
    )
    with caplog.at_level("INFO", logger="codex.eval"):
        r = CliRunner().invoke(
            cli, ["eval", "--run", run, "--tasks", "codex_missing", "--tasks-path", str(tasks)]
        )
    assert r.exit_code == 1 and "task codex_missing: its dataset could not be loaded" in r.output
    assert any("does not answer" in rec.getMessage() for rec in caplog.records)
    assert os.environ["HF_HUB_OFFLINE"] == "1" == os.environ["HF_DATASETS_OFFLINE"]


def test_the_shipped_example_task_runs_offline(tmp_path, capfd, caplog, monkeypatch):
    """configs/tasks/codex_example: `codex eval --tasks codex_example`, no --tasks-path, no
    network (the autouse fixture), from another working directory: one that is no git checkout,
    where lm-eval's git lookup used to print `fatal: not a git repository`. The terminal shows
    neither that nor lm-eval's INFO lines; RUN/logs/eval.log has the latter."""
    from click.testing import CliRunner

    from codex.cli.main import cli
    from codex.core import progress

    monkeypatch.delenv("CODEX_DEBUG", raising=False)
    run, _, _ = make_eval_run(tmp_path)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no checkout above it either
    caplog.set_level("INFO")  # as the CLI runs: the root logger at INFO
    terminal = progress.terminal_handler(sys.stderr)  # capfd's stderr, as setup_logging's would be
    logging.getLogger().addHandler(terminal)
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        progress.log_to_file(run, "codex eval")  # codex/cli/main.py does this for `codex eval`
        r = CliRunner().invoke(cli, ["eval", "--run", run, "--tasks", "codex_example"])
    finally:
        os.chdir(cwd)
        logging.getLogger().removeHandler(terminal)
        progress.close_log_file()
    assert r.exit_code == 0, r.output
    (record,) = Path(run, "eval").glob("*.tasks-*.json")
    result = json.loads(record.read_text())["tasks"]["codex_example"]
    assert result["samples"] == 8 and 0 <= result["acc"] <= 1
    err = capfd.readouterr().err
    assert "fatal:" not in err, err
    assert not re.search(r"INFO (lm_eval|transformers|datasets|huggingface_hub)", err), err
    assert re.search(r"INFO lm_eval\.", Path(run, "logs", "eval.log").read_text())
