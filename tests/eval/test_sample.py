"""eval/sample.py (greedy, top-k, seeded sampling; run_sample from a checkpoint) and eval/plot.py
(the loss plot from metrics.jsonl)."""

from __future__ import annotations

import json
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
