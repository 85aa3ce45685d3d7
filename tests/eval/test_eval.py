"""eval/evaluate.py: loss, perplexity and bits per byte on known batches (the numbers). The command
around it is tested in tests/eval/test_eval_run.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from codex.eval.evaluate import evaluate, summarize
from codex.model.gpt import build_model
from tests.fixtures.evaluation import (  # noqa: F401
    TEXT,
    batched,
    make_tokenizer,
    tiny_cfg,
    token_bytes_of,
    windows,
)

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


# --- helpers ------------------------------------------------------------------------------------


# --- evaluate: the numbers ----------------------------------------------------------------------


def test_uniform_logits_give_perplexity_equal_to_vocab_size():
    V = 300  # not a multiple of 128: the model must slice its padded head back to the real vocab
    model = build_model(tiny_cfg(V), seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0 -> uniform over the real vocab
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (5, 16), generator=g)
    y = torch.randint(0, V, (5, 16), generator=g)
    r = evaluate(model, batched(x, y, 2), torch.ones(V, dtype=torch.int32))
    assert r["tokens"] == 80
    assert abs(r["perplexity"] - V) < 1e-4
    assert abs(r["loss"] - math.log(V)) < 1e-6


def test_bits_per_byte_on_known_text_equals_hand_computation():
    tok = make_tokenizer()
    tb = token_bytes_of(tok)
    V = tok.get_vocab_size()
    text = "Grüße aus Köln ✓ déjà vu, the lazy dog."
    # <|bos|> + the text: the targets are exactly the text's tokens
    ids = [0] + tok.encode(text).ids
    T = len(ids) - 1
    x, y = windows(ids, T)

    # 1) uniform model: loss ln V per token, so bpb = tokens * log2(V) / UTF-8 bytes of the text
    model = build_model(tiny_cfg(V), seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    r = evaluate(model, [(x, y)], tb)
    n_bytes = len(text.encode("utf-8"))
    assert r["bytes"] == n_bytes
    assert r["tokens"] == T
    assert r["bits_per_byte"] == pytest.approx(T * math.log2(V) / n_bytes, rel=1e-6)

    # 2) a random model: per-token -log p computed by hand in float64 from the raw logits
    model = build_model(tiny_cfg(V), seed=3)
    with torch.no_grad():
        logits = model(x).double()[0]
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    nats = -sum(float(logp[t, y[0, t]]) for t in range(T))
    r = evaluate(model, [(x, y)], tb)
    assert r["loss"] == pytest.approx(nats / T, rel=1e-6)
    assert r["bits_per_byte"] == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-6)
    assert r["perplexity"] == pytest.approx(math.exp(nats / T), rel=1e-6)


def test_special_targets_count_zero_bytes_and_all_tokens():
    V = 300
    model = build_model(tiny_cfg(V), seed=0)
    tb = torch.full((V,), 3, dtype=torch.int32)
    tb[:3] = 0
    y = torch.tensor([[0, 1, 5, 6], [2, 7, 8, 9]])
    x = torch.zeros_like(y)
    r = evaluate(model, [(x, y)], tb)
    assert r["tokens"] == 8
    assert r["bytes"] == 5 * 3  # three special targets count 0 bytes, but they are tokens


def test_row_mask_excludes_padded_rows_exactly():
    V = 300
    model = build_model(tiny_cfg(V), seed=1)
    tb = torch.randint(1, 5, (V,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (5, 8), generator=g), torch.randint(0, V, (5, 8), generator=g)
    ref = evaluate(model, batched(x, y, 2), tb)  # batches of 2, 2, 1
    # the same 5 rows as fixed-shape batches of 4: the last one padded with 3 junk rows, masked out
    pad_x = torch.cat([x[4:], x[:3]])
    pad_y = torch.cat([y[4:], torch.full((3, 8), 7)])
    fixed = [
        (x[:4], y[:4], torch.ones(4, dtype=torch.bool)),
        (pad_x, pad_y, torch.tensor([True, False, False, False])),
    ]
    r = evaluate(model, fixed, tb)
    assert r["tokens"] == ref["tokens"] == 40
    assert r["bytes"] == ref["bytes"]
    assert r["loss"] == pytest.approx(ref["loss"], abs=1e-6)


def test_evaluate_restores_training_mode_and_rejects_empty():
    model = build_model(tiny_cfg(300), seed=0)
    model.train()
    x = torch.zeros(1, 4, dtype=torch.long)
    evaluate(model, [(x, x)], torch.ones(300, dtype=torch.int32))
    assert model.training
    with pytest.raises(ValueError, match="no tokens"):
        evaluate(model, [], torch.ones(300, dtype=torch.int32))
    with pytest.raises(ValueError, match="no tokens"):
        evaluate(model, [(x, x, torch.tensor([False]))], torch.ones(300, dtype=torch.int32))


def test_summarize_math():
    r = summarize(nats=10 * math.log(8), tokens=10, nbytes=30)
    assert r["perplexity"] == pytest.approx(8.0)
    assert r["bits_per_byte"] == pytest.approx(1.0)  # 10 tokens * 3 bits / 30 bytes
    assert math.isnan(summarize(math.nan, 10, 30)["perplexity"])  # diverged: NaN, not inf
    assert summarize(1e4, 10, 30)["perplexity"] == math.inf
    assert math.isnan(summarize(1.0, 10, 0)["bits_per_byte"])  # only special-token targets


def test_trained_tiny_model_beats_untrained():
    tok = make_tokenizer()
    tb = token_bytes_of(tok)
    V = tok.get_vocab_size()
    ids = [0] + tok.encode(TEXT * 3).ids
    T = 32
    x, y = windows(ids, T)
    split = max(1, len(x) // 5)
    val = batched(x[:split], y[:split], 4)
    train_x, train_y = x[split:], y[split:]

    torch.manual_seed(0)
    model = build_model(tiny_cfg(V), seed=0)
    before = evaluate(model, val, tb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        idx = torch.randint(0, len(train_x), (8,), generator=g)
        loss = model(train_x[idx], targets=train_y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = evaluate(model, val, tb)
    assert before["loss"] == pytest.approx(math.log(V), abs=0.3)  # untrained: near uniform
    assert after["loss"] < before["loss"] - 1.0
    assert after["bits_per_byte"] < before["bits_per_byte"]
    assert after["tokens"] == before["tokens"] and after["bytes"] == before["bytes"]
