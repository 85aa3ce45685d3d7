"""`codex data stats` (pipeline/clean/report.py): histograms of kept and dropped documents in
RUN/clean/stats/, a PNG, the rule that dropped the most bytes."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from codex.cli.main import cli
from codex.pipeline.clean import report
from codex.pipeline.clean.clean import run_clean
from tests.fixtures.clean import cfg_for, prose


def _clean(tmp_path, *more):
    """10 prose documents, 4 short ones (gopher_quality:short_doc) and one long junk document
    that drops the most bytes (the same line 400 times: gopher_repetition)."""
    d = tmp_path / "in"
    d.mkdir()
    docs = [prose(k) for k in range(10)] + [f"short note {k}." for k in range(4)]
    docs.append("the same line again and again.\n" * 400)
    with open(d / "a.jsonl", "w") as fh:
        for t in docs:
            fh.write(json.dumps({"text": t}) + "\n")
    run_clean(cfg_for(tmp_path, [d], "data.clean.allow_low_yield=true", *more))
    return tmp_path / "run"


def test_histograms_count_every_document_in_its_bin():
    h = report.Histograms()
    h.add(
        pa.table({"text": ["", "abc", "x" * 50, "one two three"], "score": [0.1, 0.97, None, 1.0]})
    )
    assert h.docs == 4 and h.chars.sum() == 4 and h.words.sum() == 4
    # 50 characters: the bin [10**1.5, 10**1.75)
    assert h.chars[int(np.searchsorted(report.CHAR_EDGES, 50, side="right")) - 1] == 1
    assert h.scores["score"].sum() == 3 and h.scores["score"][-1] == 2
    # "one two three": mean word length 11/3 (bin [3.5, 4)), every word with a letter
    assert h.signals["avg_word_length"][7] == 1 and h.signals["alpha_words_ratio"][-1] == 3
    assert report.signals("a\nb\na\na") == (1.0, 1.0, 0.0, 0.5)


@pytest.mark.slow
def test_stats_writes_json_and_png_and_names_the_top_rule(tmp_path):
    run = _clean(tmp_path, "data.clean.keep_rejected=true")
    result = CliRunner().invoke(cli, ["data", "stats", "--run", str(run)])
    assert result.exit_code == 0, result.output
    out = run / "clean" / "stats"
    saved = json.loads((out / "stats.json").read_text())
    assert (out / "stats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    top = saved["top_rule_by_bytes"]
    assert top["rule"].startswith("gopher_repetition:") and top["rule"] in result.output
    groups = saved["groups"]
    assert groups["kept"]["docs"] == 10 and groups["dropped"]["docs"] == 5
    assert groups["dropped:gopher_quality"]["docs"] == 4
    assert sum(groups["kept"]["chars"]) == 10 and "note" not in saved
    # the repeated line's document: every line but one a duplicate (the last bin)
    assert groups["dropped:gopher_repetition"]["signals"]["dup_line_frac"][-1] == 1


def test_without_rejected_rows_it_says_so_and_a_run_without_clean_exits_2(tmp_path):
    run = _clean(tmp_path)
    r = report.corpus_stats(str(run))
    assert r["groups"]["dropped"]["docs"] == 0 and "--keep-rejected" in r["note"]
    result = CliRunner().invoke(cli, ["data", "stats", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "codex data clean" in result.output
