"""bf16 activations (model/gpt.py: GPT.embed, RMSNorm): under bf16 autocast the residual stream is
bf16 and no fp32 [B, T, d] copy of it is kept for the backward, while the parameters stay fp32;
a bf16 training run on the CPU follows the fp32 loss curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from codex.core.config import build_config
from codex.core.config.model import ModelConfig
from codex.eval.evaluate import evaluate
from codex.model.gpt import build_model
from codex.train.loop import train
from tests.fixtures.runs import base_overrides, make_run

torch.set_num_threads(1)

CFG = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=300, max_seq_len=32)


def test_residual_stream_is_bf16_under_autocast_and_fp32_without():
    model = build_model(CFG, seed=0)
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, out.dtype)))
    idx = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * CFG.n_layer
    assert loss.dtype == torch.float32  # the loss itself in fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    seen.clear()
    model(idx, idx)
    assert seen == [(torch.float32, torch.float32)] * CFG.n_layer


def test_no_fp32_copy_of_the_residual_stream_is_kept_for_the_backward():
    """Every tensor autograd keeps for the backward of the blocks and norms: none is an fp32
    [B, T, d] activation (the residual stream or a norm's input upcast)."""
    model = build_model(CFG, seed=0)
    B, T, d = 2, 32, CFG.n_embd
    idx = torch.randint(0, 300, (B, T), generator=torch.Generator().manual_seed(0))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = model.embed(idx)
            for block in model.blocks:
                x = block(x, model.rope_cos[:T], model.rope_sin[:T])
            x = model.norm_f(x)
    activations = [t for t in saved if t.numel() == B * T * d]
    assert activations and all(t.dtype == torch.bfloat16 for t in activations), sorted(
        {(tuple(t.shape), t.dtype) for t in activations}, key=str
    )


def losses(run: str) -> list[float]:
    recs = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["kind"] == "train"]


@pytest.mark.slow
def test_bf16_training_follows_the_fp32_loss_curve_within_2_percent(tmp_path):
    curves = {}
    for dtype in ("fp32", "bf16"):
        run = make_run(tmp_path / dtype)
        train(
            build_config(
                overrides=base_overrides(max_steps=20, dtype=dtype, device_batch=8, seq_len=32),
                run=run,
            ),
            evaluate,
        )
        curves[dtype] = losses(run)
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert len(fp32) == len(bf16) == 20
    assert fp32[-1] < fp32[0] - 0.5  # it learns, so the comparison covers a moving curve
    worst = max(abs(b - f) / f for f, b in zip(fp32, bf16, strict=True))
    assert worst < 0.02, (worst, fp32, bf16)
