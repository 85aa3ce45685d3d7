"""eval/sample.py (greedy, top-k, seeded sampling; run_sample from a checkpoint) and eval/plot.py
(the loss plot from metrics.jsonl)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from codex.model.gpt import build_model
from tests.fixtures.evaluation import (
    eval_cfg,
    make_eval_run,
    make_tokenizer,
    tiny_cfg,
    write_metrics,
)

torch.set_num_threads(1)


# --- sampling -------------------------------------------------------------------------------------


def test_sample_greedy_topk_seed_and_crop():
    from codex.eval.sample import sample

    tok = make_tokenizer()
    model = build_model(tiny_cfg(tok.get_vocab_size(), max_seq_len=16), seed=2)
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # longer than max_seq_len: cropped
    assert len(tok.encode(prompt).ids) + 1 > 16

    # greedy by hand
    ids = [0] + tok.encode(prompt).ids
    with torch.no_grad():
        for _ in range(10):
            nxt = int(model(torch.tensor([ids[-16:]]))[0, -1].argmax())
            if nxt in (0, 1):
                break
            ids.append(nxt)
    greedy = tok.decode(ids, skip_special_tokens=True)
    assert sample(model, tok, prompt, max_new_tokens=10, temperature=0) == greedy
    assert sample(model, tok, prompt, max_new_tokens=10, temperature=1.0, top_k=1, seed=5) == greedy
    assert greedy.startswith(prompt)

    a = sample(model, tok, "def add", max_new_tokens=20, temperature=1.5, top_k=0, seed=1)
    b = sample(model, tok, "def add", max_new_tokens=20, temperature=1.5, top_k=0, seed=1)
    c = sample(model, tok, "def add", max_new_tokens=20, temperature=1.5, top_k=0, seed=2)
    assert a == b and a != c and a.startswith("def add")
    with pytest.raises(ValueError, match="temperature"):
        sample(model, tok, "x", temperature=-1)


def test_run_sample_loads_the_checkpoint(tmp_path):
    from codex.eval.sample import run_sample, sample

    run, tok, model = make_eval_run(tmp_path)
    got = run_sample(eval_cfg(run, max_new_tokens=8, temperature=0), "The quick")
    assert got == sample(model, tok, "The quick", max_new_tokens=8, temperature=0)


@pytest.mark.parametrize(("ends_at", "stop"), [(4, "<|eos|>"), (2, "<|bos|>"), (None, None)])
def test_a_sample_says_why_it_stopped(monkeypatch, ends_at, stop):
    """The model writing <|eos|> or <|bos|> after N tokens ends the text there, and says so; else
    max_new_tokens ends it."""
    from codex.eval import sample as sampling

    tok = make_tokenizer()
    model = build_model(tiny_cfg(tok.get_vocab_size()), seed=0)
    word = tok.encode(" f").ids[0]
    drawn = []

    def pick(*_):
        drawn.append(1)
        return tok.token_to_id(stop) if len(drawn) == ends_at else word

    monkeypatch.setattr(sampling, "pick_token", pick)
    out = sampling.continue_prompt(model, tok, "The quick", max_new_tokens=10, temperature=0)
    assert out.stop == stop
    if stop is None:
        assert out.new_tokens == 10 and len(drawn) == 10
        assert out.why() == (
            "stopped after 10 new tokens, the limit (--max-new-tokens, eval.max_new_tokens)"
        )
    else:
        assert out.new_tokens == ends_at - 1 and len(drawn) == ends_at
        assert out.why().startswith(
            f"stopped after {ends_at - 1} of at most 10 new tokens: the model wrote {stop}, "
        )
    assert out.text == "The quick" + " f" * out.new_tokens
    drawn.clear()
    assert out.text == sampling.sample(model, tok, "The quick", max_new_tokens=10, temperature=0)


def test_sample_and_eval_log_under_their_own_names(tmp_path, caplog):
    """`codex sample` and `codex eval` log as codex.sample and codex.eval, the backend's lines
    included (never codex.train); sample's one line says why it stopped. The name is put back
    when the command ends."""
    import os

    from click.testing import CliRunner

    from codex.cli.main import cli

    run, _, _ = make_eval_run(tmp_path)
    before = os.environ.get("CODEX_COMMAND")
    for command, extra in (
        ("sample", ["--prompt", "The quick", "--max-new-tokens", "3", "--temperature", "0"]),
        ("eval", []),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            res = CliRunner().invoke(cli, [command, "--run", run, *extra])
        assert res.exit_code == 0, res.output
        names = {r.name for r in caplog.records if r.name.startswith("codex")}
        assert "codex.train" not in names and "codex" not in names, names
        threads = [r.name for r in caplog.records if r.getMessage().startswith("threads: ")]
        assert threads == [f"codex.{command}"], threads
        assert os.environ.get("CODEX_COMMAND") == before
        said = [r.name for r in caplog.records if r.getMessage().startswith("stopped after ")]
        assert said == (["codex.sample"] if command == "sample" else []), said


# --- the loss plot --------------------------------------------------------------------------------


def test_plot_loss_writes_a_png_and_dedups_resumed_steps(tmp_path):
    from codex.eval.plot import loss_curves, plot_loss, read_metrics

    run = tmp_path / "run"
    rows = [
        {"kind": "train", "step": s, "tokens": 1000 * s, "loss": 5.0 - 0.1 * s}
        for s in range(1, 11)
    ]
    rows += [
        {"kind": "val", "step": 5, "tokens": 5000, "loss": 4.9, "bits_per_byte": 2.0},
        {"kind": "train", "step": 10, "tokens": 10000, "loss": 3.5},  # a resumed run redoes step 10
        {"kind": "val", "step": 10, "tokens": 10000, "loss": 4.2},
    ]
    write_metrics(run, [json.dumps(r) for r in rows] + ['{"kind": "train", "ste'])  # torn last line
    curves = loss_curves(read_metrics(str(run / "metrics.jsonl")))
    assert len(curves["train"]) == 10 and curves["train"][-1] == (10000.0, 3.5)
    assert curves["val"] == [(5000.0, 4.9), (10000.0, 4.2)]
    path = plot_loss(str(run))
    assert path == str(run / "eval" / "loss.png")
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_loss_errors_name_the_file_and_line(tmp_path):
    from codex.eval.plot import plot_loss

    run = tmp_path / "run"
    write_metrics(run, ['{"kind": "train", "step": 1, "tokens": 10, "loss": 3}', "not json", "{}"])
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2"):
        plot_loss(str(run))
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_loss(str(tmp_path / "nothing"))
