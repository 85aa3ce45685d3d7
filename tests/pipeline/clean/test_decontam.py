"""Decontamination (pipeline/clean/decontam.py): n-gram matching after normalisation, drop and
mark modes, counts per eval set, both local executors alike, bad eval sets exit 2."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from codex.cli.main import cli
from codex.core.config import ConfigError
from codex.pipeline.clean import decontam
from codex.pipeline.clean.clean import run_clean
from codex.pipeline.clean.plan import plan_fingerprint
from codex.pipeline.clean.stats import source_summary
from tests.fixtures.clean import cfg_for, prose, read_out, snapshot

# 20 words; its first 13 are the injected n-gram
QUESTION = (
    "Which ancient philosopher argued that the unexamined life is not worth living for a "
    "human being according to Plato"
)
WORDS = QUESTION.split()


def _corpus(tmp_path, n_docs=40):
    """Prose documents; document 3 holds the question's first 13 words, changed in case,
    punctuation and white space; document 5 only its first 12 words; document 7 a whole
    question of the second set."""
    docs = [prose(k) for k in range(n_docs)]
    thirteen = " ".join(WORDS[:13]).upper().replace(" ", ",\n  ", 3) + "!"
    docs[3] = docs[3].replace("It was recorded", f"Some said: {thirteen} It was recorded")
    docs[5] = docs[5].replace("It was recorded", f"Some said {' '.join(WORDS[:12])}. It was")
    docs[7] += (
        "\nWhat is the boiling point of water at sea level in degrees Celsius on a normal day?"
    )
    d = tmp_path / "in"
    d.mkdir()
    with open(d / "a.jsonl", "w") as fh:
        for t in docs:
            fh.write(json.dumps({"text": t}) + "\n")
    evals = tmp_path / "evals"
    evals.mkdir()
    with open(evals / "philo.jsonl", "w") as fh:
        fh.write(json.dumps({"text": QUESTION, "label": 1}) + "\n")
        fh.write(json.dumps({"text": "too short to match"}) + "\n")
    (evals / "science.txt").write_text(
        "What is the boiling point of water at sea level\nin degrees Celsius on a normal day?\n"
    )
    return d, [str(evals / "philo.jsonl"), str(evals / "science.txt")]


def _args(sets, *more):
    return (
        "data.clean.decontam.enabled=true",
        f"data.clean.decontam.eval_sets={json.dumps(sets)}",
        "data.clean.preset=trusted",
        *more,
    )


def test_ngram_hashes_see_through_case_punctuation_and_white_space():
    a = decontam.ngram_hashes(QUESTION, 13)
    b = decontam.ngram_hashes("  " + QUESTION.upper().replace(" ", " ,\n\t\u00a0") + "?", 13)
    assert len(a) == len(WORDS) - 12 and (a == b).all()
    assert len(set(a.tolist())) == len(a)
    assert not len(decontam.ngram_hashes(" ".join(WORDS[:12]), 13))
    # a word's hash is its bytes': the same word in ASCII and non-ASCII text, others differ
    words = decontam.ngram_hashes("é " + " ".join(WORDS[:13]), 13)
    assert words[1] == a[0] and words[0] != a[0]


def test_drop_mode_drops_the_13_gram_only_and_counts_per_set(tmp_path):
    d, sets = _corpus(tmp_path)
    stats = run_clean(cfg_for(tmp_path, [d], *_args(sets), "data.clean.keep_rejected=true"))
    assert stats["drops"]["decontam"] == {"philo": 1, "science": 1}
    assert stats["decontam"]["philo"]["docs"] == 1 and stats["decontam"]["science"]["docs"] == 1
    kept = {r["text"] for r in read_out(str(tmp_path / "run"))}
    assert len(kept) == 38  # documents 3 and 7, of the years 1003 and 1007, dropped
    assert not any(f"year {y}." in t for t in kept for y in (1003, 1007))
    assert any(" ".join(WORDS[:12]) in t for t in kept)  # 12 shared words: kept
    rejected = [
        r
        for p in (tmp_path / "run" / "clean" / "rejected").glob("*.parquet")
        for r in pq.read_table(p).to_pylist()
    ]
    assert sorted(r["reason"] for r in rejected) == ["decontam:philo", "decontam:science"]
    lines = source_summary(stats)
    assert any("philo 1" in line and "science 1" in line for line in lines)
    assert any("decontam:philo" in line and "mode=mark" in line for line in lines)
    saved = json.loads((tmp_path / "run" / "clean" / "stats.json").read_text())
    assert saved["decontam"] == stats["decontam"]
    assert list((tmp_path / "run" / "clean" / "decontam").glob("ngrams-*.npy"))


def test_mark_mode_keeps_the_documents_with_their_set(tmp_path):
    d, sets = _corpus(tmp_path)
    stats = run_clean(cfg_for(tmp_path, [d], *_args(sets, "data.clean.decontam.mode=mark")))
    assert "decontam" not in stats["drops"] and stats["decontam"]["philo"]["docs"] == 1
    rows = read_out(str(tmp_path / "run"))
    assert len(rows) == 40
    marked = sorted(r["contaminated"] for r in rows if r["contaminated"])
    assert marked == ["philo", "science"]
    # a rerun resumes; one with a changed eval set is refused like any changed setting
    again = run_clean(cfg_for(tmp_path, [d], *_args(sets, "data.clean.decontam.mode=mark")))
    assert again["units_run"] == 0
    with open(sets[1], "a") as fh:
        fh.write("and one more line that makes new n-grams of this eval set for the rerun\n")
    with pytest.raises(Exception, match="other inputs or settings"):
        run_clean(cfg_for(tmp_path, [d], *_args(sets, "data.clean.decontam.mode=mark")))


@pytest.mark.slow
def test_one_and_two_workers_give_identical_parts(tmp_path):
    d, sets = _corpus(tmp_path, n_docs=120)
    args = (*_args(sets), "data.clean.chunk_bytes=20000", "data.clean.part_bytes=0")
    s1 = run_clean(cfg_for(tmp_path, [d], *args, run="w1"))
    s2 = run_clean(cfg_for(tmp_path, [d], *args, "data.clean.workers=2", run="w2"))
    assert s1["units"] > 2 and s1["drops"]["decontam"] == {"philo": 1, "science": 1}
    assert snapshot(tmp_path / "w1") == snapshot(tmp_path / "w2")
    assert s1["decontam"] == s2["decontam"]


def test_the_eval_sets_content_is_part_of_the_fingerprint(tmp_path):
    d, sets = _corpus(tmp_path)
    cfg = cfg_for(tmp_path, [d], *_args(sets))
    c = cfg.data.clean
    before = decontam.read_eval_sets(c.decontam).fingerprint
    with open(sets[1], "a") as fh:
        fh.write("one more line of the eval set that changes its n-grams entirely here\n")
    after = decontam.read_eval_sets(c.decontam).fingerprint
    assert before != after and plan_fingerprint(c, [], before) != plan_fingerprint(c, [], after)


def test_bad_or_empty_eval_sets_exit_2_naming_them(tmp_path):
    d, sets = _corpus(tmp_path)
    (tmp_path / "evals" / "empty.txt").write_text("four words only here\n")
    missing = str(tmp_path / "evals" / "nope.jsonl")
    for bad, said in (
        (missing, "cannot read"),
        (str(tmp_path / "evals" / "empty.txt"), "no document"),
    ):
        with pytest.raises(ConfigError, match=said):
            decontam.read_eval_sets(cfg_for(tmp_path, [d], *_args([bad])).data.clean.decontam)
        result = CliRunner().invoke(
            cli,
            [
                "data",
                "clean",
                "--run",
                str(tmp_path / "r"),
                "--input",
                str(d),
                "--preset",
                "trusted",
                "--set",
                "data.clean.decontam.enabled=true",
                "--set",
                f"data.clean.decontam.eval_sets={json.dumps([bad])}",
            ],
        )
        assert result.exit_code == 2, result.output
        assert "data.clean.decontam.eval_sets" in result.output and bad in result.output


@pytest.mark.slow
def test_ray_workers_read_the_table_and_give_the_same_parts(tmp_path, ray_cluster):
    d, sets = _corpus(tmp_path, n_docs=120)
    args = (*_args(sets, "data.clean.decontam.mode=mark"), "data.clean.chunk_bytes=20000")
    local = run_clean(cfg_for(tmp_path, [d], *args, "data.clean.workers=1", run="local"))
    cfg = cfg_for(tmp_path, [d], *args, run="ray")
    cfg.data.executor, cfg.data.ray_address = "ray", ray_cluster
    on_ray = run_clean(cfg)
    assert local["decontam"] == on_ray["decontam"] and local["decontam"]["philo"]["docs"] == 1
    assert snapshot(tmp_path / "local") == snapshot(tmp_path / "ray")
    assert sum(r["contaminated"] is not None for r in read_out(str(tmp_path / "ray"))) == 2


def test_every_injected_13_gram_and_nothing_else_is_dropped(tmp_path):
    """Windows of an eval set's text injected into prose at random places, in random case and
    punctuation: the 13-word ones are all dropped, the 12-word ones all kept."""
    rng = random.Random(5)
    eval_text = [
        f"{rng.choice(['alpha', 'beta', 'gamma', 'delta'])}{rng.randrange(50)}" for _ in range(300)
    ]
    docs, injected = [], set()
    for k in range(60):
        words = prose(k).split()
        if k % 3:
            size = 13 if k % 3 == 1 else 12
            at = rng.randrange(len(eval_text) - size)
            window = [w.upper() if rng.random() < 0.3 else w for w in eval_text[at : at + size]]
            words[rng.randrange(len(words)) : 0] = [w + rng.choice(["", ",", ";"]) for w in window]
            injected |= {k} if size == 13 else set()
        docs.append(" ".join(words) + f" {k}")
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "a.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    (tmp_path / "held.txt").write_text(
        "\n".join(" ".join(eval_text[i : i + 9]) for i in range(0, len(eval_text), 9))
    )
    stats = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *_args([str(tmp_path / "held.txt")])))
    kept = {int(r["text"].rsplit(" ", 1)[1]) for r in read_out(str(tmp_path / "run"))}
    assert set(range(60)) - kept == injected and len(injected) == 20
    assert stats["decontam"]["held"]["docs"] == 20


@pytest.mark.slow
def test_an_lm_eval_task_is_an_eval_set(tmp_path, monkeypatch):
    """`lm-eval:codex_example` (the task codex ships, offline): its prompts with their gold
    answers are the set; a document holding one ("One, two, three, four, five") is dropped as
    decontam:codex_example, one holding a wrong answer is kept."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = [prose(k) for k in range(6)]
    docs[1] += "\nShe counted: one, two, three, four, five!"
    docs[2] += "\nShe counted: one, two, three, four, apple."
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "a.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    args = _args(["lm-eval:codex_example"], "data.clean.decontam.n=5")
    stats = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args))
    assert stats["drops"]["decontam"] == {"codex_example": 1}
    kept = {r["text"] for r in read_out(str(tmp_path / "run"))}
    assert docs[1] not in kept and docs[2] in kept and len(kept) == 5
