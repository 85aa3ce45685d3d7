"""model.attention (model/gpt.py sdpa_causal, train/xla/flash.py): what can run off a TPU.
The GQA head mapping of the flash path, its SPMD partition spec, the model's kernel hook, and the
refusal of model.attention=flash on a CPU preset (the XLA CPU backend's refusal is in
tests/test_xla.py, NO_FALLBACK). The Pallas kernel itself runs only on a TPU: not tested here."""

from __future__ import annotations

import math
import subprocess
import sys

import torch

from codex.core.config.model import ModelConfig
from codex.model.gpt import build_model, sdpa_causal
from codex.train.xla.flash import REQUIREMENT, expand_kv_heads, flash_partition_spec
from tests.train_helpers import base_overrides, child_env, make_run

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
torch.set_num_threads(1)


def test_expand_kv_heads_maps_query_head_h_to_kv_head_h_over_group():
    B, H, KV, T, D = 2, 8, 2, 5, 4
    kv = torch.randn(B, KV, T, D)
    full = expand_kv_heads(kv, H)
    assert full.shape == (B, H, T, D)
    for h in range(H):
        assert torch.equal(full[:, h], kv[:, h // (H // KV)])
    assert expand_kv_heads(full, H) is full  # MHA: no copy


def test_expanded_heads_give_sdpa_with_enable_gqa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 6, 16, 8, generator=g),
        torch.randn(2, 3, 16, 8, generator=g),
        torch.randn(2, 3, 16, 8, generator=g),
    )
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, expand_kv_heads(k, 6), expand_kv_heads(v, 6), is_causal=True
    )
    assert (plain - sdpa_causal(q, k, v)).abs().max().item() < 1e-6


def test_flash_partition_spec_shards_the_batch_over_the_mesh():
    assert flash_partition_spec(("data",)) == ("data", None, None, None)
    assert flash_partition_spec(("data", "fsdp")) == (("data", "fsdp"), None, None, None)
    assert flash_partition_spec(None) is None and flash_partition_spec(()) is None


def test_set_attention_routes_every_block_through_the_kernel():
    """GPT.set_attention is the hook the XLA backend uses for flash: an explicit-softmax kernel
    with expand_kv_heads (the flash path's GQA handling) gives the SDPA model's logits, and it
    is really called once per block."""
    cfg = ModelConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=64, vocab_size=300, max_seq_len=16)
    model = build_model(cfg, seed=0)
    idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(idx)
    calls = []

    def explicit(q, k, v):
        calls.append(q.shape)
        k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
        T = q.shape[2]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v

    model.set_attention(explicit)
    with torch.no_grad():
        got = model(idx)
    assert len(calls) == 3 and calls[0] == (2, 4, 16, 16)
    assert (got - want).abs().max().item() < 1e-5


def test_flash_on_a_cpu_preset_exits_2_naming_the_requirement(tmp_path):
    run = make_run(tmp_path / "run")
    args = ["--run", run]
    for o in base_overrides(max_steps=1) + ["model.attention=flash"]:
        args += ["--set", o]
    proc = subprocess.run(
        [sys.executable, "-m", "codex.cli", "train", *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT),
    )
    assert proc.returncode == 2, proc.stderr
    err = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(err) == 1 and REQUIREMENT in err[0] and "'cpu' is a cpu preset" in err[0], (
        proc.stderr
    )
    assert "model.attention=sdpa" in err[0] and "Traceback" not in proc.stderr
