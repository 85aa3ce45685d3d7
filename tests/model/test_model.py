"""The model: forward equals an independent explicit-softmax reference, causality, the loss
contract, identical initial weights on every rank, presets and FLOPs accounting."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from codex.core.config import build_config, preset_names
from codex.core.config.model import ModelConfig
from codex.model.gpt import (
    GPT,
    build_model,
    flops_per_token,
    matmul_params,
    num_params,
    padded_vocab,
)

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


def tiny(**kw) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, n_kv_head=4, n_embd=64, vocab_size=300, max_seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


def reference_forward(m: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The same network written out by hand: explicit softmax attention with a causal mask, K/V
    heads repeated for GQA, no SDPA. Shares nothing with model/gpt.py but the parameters."""
    cfg = m.cfg
    B, T = idx.shape
    H, KV, D = cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    pos = torch.arange(T, dtype=torch.float64)[:, None]
    freq = cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = torch.cos(pos * freq).float(), torch.sin(pos * freq).float()

    def rope(x):  # rotate pairs (i, i + D/2)
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    x = m.wte.weight[idx]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for blk in m.blocks:
        at = blk.attn
        h = rms(x, blk.attn_norm.weight)
        q = (h @ at.c_q.weight.T).view(B, T, H, D).transpose(1, 2)
        k = (h @ at.c_k.weight.T).view(B, T, KV, D).transpose(1, 2)
        v = (h @ at.c_v.weight.T).view(B, T, KV, D).transpose(1, 2)
        if cfg.qk_norm:
            q, k = rms(q, at.q_norm.weight), rms(k, at.k_norm.weight)
        q, k = rope(q), rope(k)
        k = torch.cat([k[:, i // (H // KV) : i // (H // KV) + 1] for i in range(H)], 1)
        v = torch.cat([v[:, i // (H // KV) : i // (H // KV) + 1] for i in range(H)], 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, H * D)
        x = x + y @ at.c_proj.weight.T
        h = rms(x, blk.mlp_norm.weight)
        mlp = blk.mlp
        if cfg.mlp == "swiglu":
            u = torch.nn.functional.silu(h @ mlp.w_gate.weight.T) * (h @ mlp.w_up.weight.T)
        else:
            u = torch.relu(h @ mlp.w_up.weight.T) ** 2
        x = x + u @ mlp.w_down.weight.T
    return (rms(x, m.norm_f.weight) @ m.lm_head.weight.T)[..., : cfg.vocab_size]


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_kv_head=4),
        dict(n_kv_head=2),
        dict(n_kv_head=1, mlp="relu2"),
        dict(n_kv_head=2, qk_norm=False, tie_embeddings=True),
    ],
)
def test_forward_matches_explicit_softmax_reference(kw):
    m = build_model(tiny(**kw), seed=0)
    idx = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = m(idx), reference_forward(m, idx)
    assert got.shape == (3, 20, 300)
    assert (got - want).abs().max().item() < 1e-5


def test_attention_is_causal():
    m = build_model(tiny(n_kv_head=2), seed=0)
    idx = torch.randint(0, 300, (2, 16))
    idx2 = idx.clone()
    idx2[:, 10:] = (idx2[:, 10:] + 1) % 300
    with torch.no_grad():
        a, b = m(idx), m(idx2)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:], atol=1e-3)


def test_loss_contract_padded_vocab_and_per_token_losses():
    m = build_model(tiny(vocab_size=300), seed=0)
    assert m.wte.weight.shape[0] == m.lm_head.weight.shape[0] == 384 == padded_vocab(300)
    idx = torch.randint(0, 300, (2, 12))
    tgt = torch.randint(0, 300, (2, 12))
    logits = m(idx)
    per_tok = m(idx, tgt, reduction="none")
    assert per_tok.shape == (2, 12) and per_tok.dtype == torch.float32
    manual = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 300), tgt.reshape(-1), reduction="none"
    )
    # softmax over the real vocab only
    assert torch.allclose(per_tok.reshape(-1), manual, atol=1e-6)
    assert torch.allclose(m(idx, tgt), per_tok.mean(), atol=1e-6)
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 33, dtype=torch.long))


def test_backward_reaches_every_parameter_and_tie_survives_moves():
    m = build_model(tiny(n_kv_head=2, tie_embeddings=True), seed=0)
    assert m.lm_head.weight is m.wte.weight
    m = m.to(torch.float64).to(torch.float32)
    assert m.lm_head.weight is m.wte.weight
    m(torch.randint(0, 300, (2, 8)), torch.randint(0, 300, (2, 8))).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_init_depends_on_the_seed_only():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = build_model(tiny(), seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left alone
    torch.manual_seed(999)
    b = build_model(tiny(), seed=7)
    c = build_model(tiny(), seed=8)
    for (k, p), q, _r in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), k
    assert not torch.equal(a.wte.weight, c.wte.weight)
    # residual projections are scaled down by 1/sqrt(2 * n_layer)
    assert a.blocks[0].attn.c_proj.weight.std() < 0.6 * a.blocks[0].attn.c_q.weight.std()


@pytest.mark.slow  # two fresh interpreters importing torch: ~20-30 s on 2 busy cores
def test_two_processes_with_different_ranks_build_identical_weights():
    script = textwrap.dedent("""
        import hashlib, sys, torch
        rank = int(sys.argv[1])
        torch.manual_seed(rank)            # what a per-rank seeded process would do first
        torch.rand(rank * 17 + 1)
        from codex.core.config.model import ModelConfig
        from codex.model.gpt import build_model
        m = build_model(ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=300,
                                    max_seq_len=32, tie_embeddings=True), seed=1337)
        h = hashlib.sha256()
        for k, v in sorted(m.state_dict().items()):
            h.update(k.encode()); h.update(v.numpy().tobytes())
        print(h.hexdigest())
    """)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r)],
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        )
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    assert len(outs[0]) == 64 and outs[0] == outs[1]
    # and equal to this process's
    m = build_model(tiny(n_kv_head=2, tie_embeddings=True), seed=1337)
    h = hashlib.sha256()
    for k, v in sorted(m.state_dict().items()):
        h.update(k.encode())
        h.update(v.numpy().tobytes())
    assert h.hexdigest() == outs[0]


def test_bad_shapes_name_the_key():
    with pytest.raises(ValueError, match="n_kv_head"):
        GPT(tiny(n_head=4, n_kv_head=3))
    with pytest.raises(ValueError, match="vocab_size"):
        GPT(tiny(vocab_size=0))


@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token_is_6n_plus_attention(tie):
    cfg = tiny(n_kv_head=2, tie_embeddings=tie)
    m = build_model(cfg, 0)
    n_lookup = m.wte.weight.numel()
    expected_n = num_params(m) - (n_lookup if not tie else 0)  # tied: the head matmul still counts
    assert matmul_params(cfg) == expected_n
    hd = cfg.n_embd // cfg.n_head
    # attention in MaxText's convention: causal, half of the full square's 12 L H hd T
    assert flops_per_token(cfg, 16) == 6 * expected_n + 6 * cfg.n_layer * cfg.n_head * hd * 16
    assert (
        flops_per_token(cfg, 32) - flops_per_token(cfg, 16)
        == 6 * cfg.n_layer * cfg.n_head * hd * 16
    )


@pytest.mark.parametrize(
    "name,lo,hi",
    [
        ("tiny", 1e6, 20e6),
        ("124m", 100e6, 150e6),
        ("350m", 300e6, 400e6),
        ("1b", 0.9e9, 1.3e9),
        ("7b", 7.0e9, 7.5e9),
    ],
)
def test_presets_build_with_the_advertised_size(name, lo, hi):
    assert name in preset_names("model")
    cfg = dataclasses.replace(build_config(model=name).model, vocab_size=32768)
    with torch.device("meta"):  # shapes only, no memory
        m = GPT(cfg)
    assert lo <= num_params(m) <= hi
    if name in ("350m", "1b", "7b"):
        assert cfg.n_kv_head < cfg.n_head  # GQA on by default for the larger ones


@pytest.mark.xla
@pytest.mark.slow  # one XLA compile of forward+backward: ~30-60 s on 2 busy cores
def test_forward_backward_lowers_under_xla_and_matches_cpu():
    pytest.importorskip("torch_xla")
    from tests.fixtures.procs import run_xla

    out = run_xla(
        textwrap.dedent("""
        import torch, torch_xla, torch_xla.debug.metrics as met
        from codex.core.config.model import ModelConfig
        from codex.model.gpt import build_model
        # before any CPU backward: the autograd engine sizes its device queues once
        dev = torch_xla.device()
        cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=300,
                          max_seq_len=32, tie_embeddings=True)
        m = build_model(cfg, 0)
        idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = m(idx, idx.roll(1, 1)); loss.backward()
        g = {k: p.grad.clone() for k, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        mx = m.to(dev)
        assert mx.lm_head.weight is mx.wte.weight
        lx = mx(idx.to(dev), idx.roll(1, 1).to(dev)); lx.backward(); torch_xla.sync()
        # ops XLA could not lower
        fallbacks = [n for n in met.counter_names() if n.startswith("aten::")]
        assert not fallbacks, fallbacks
        assert abs(lx.item() - loss.item()) < 1e-4, (lx.item(), loss.item())
        worst = max((p.grad.cpu() - g[k]).abs().max().item() for k, p in mx.named_parameters())
        assert worst < 1e-5, worst
        print("OK", worst)
    """)
    )
    assert "OK" in out.stdout


def test_zero_init_proj_makes_every_block_the_identity_and_still_trains():
    m = build_model(tiny(zero_init_proj=True), seed=0)
    x = torch.randn(2, 8, m.cfg.n_embd)
    cos, sin = m.rope_cos[:8], m.rope_sin[:8]
    for block in m.blocks:
        assert torch.equal(block(x, cos, sin), x)  # x + attn(...) + mlp(...) with zero projections
    idx = torch.randint(0, m.vocab_size, (2, 8))
    m(idx, idx).backward()
    assert m.blocks[0].attn.c_proj.weight.grad.abs().sum() > 0  # the projections get gradient
    assert not torch.equal(
        build_model(tiny(), seed=0).blocks[0].mlp.w_down.weight,
        torch.zeros_like(m.blocks[0].mlp.w_down.weight),
    )


def test_logit_softcap_bounds_the_logits_and_is_refused_by_the_export():
    from codex.core.config import ConfigError
    from codex.model.export_hf import check_exportable

    raw = build_model(tiny(init_std=2.0), seed=0)
    capped = build_model(tiny(init_std=2.0, logit_softcap=5.0), seed=0)
    idx = torch.randint(0, raw.vocab_size, (2, 8))
    a, b = raw(idx), capped(idx)
    assert a.abs().max() > 5.0 and b.abs().max() <= 5.0
    assert torch.allclose(b, 5.0 * torch.tanh(a / 5.0), atol=1e-5)
    with pytest.raises(ConfigError, match="model.logit_softcap=5.0"):
        check_exportable(capped.cfg)
    check_exportable(build_model(tiny(zero_init_proj=True), seed=0).cfg)  # an init choice exports


def test_value_embeddings_add_a_per_token_vector_to_alternate_layers_values():
    from codex.core.config import ConfigError
    from codex.model.export_hf import check_exportable
    from codex.model.gpt import decode, prefill

    m = build_model(tiny(n_layer=4, n_kv_head=2, value_embed=True), seed=0).eval()
    assert sorted(m.value_embeds) == ["1", "3"]  # every other layer, the last included
    assert m.value_embeds["3"].weight.shape == (m.padded_vocab, 2 * 16)  # n_kv_head x head_dim
    idx = torch.randint(0, m.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_ve = m(idx)
        logits, cache = prefill(m, idx[:, :5])  # the KV cache sees them too
        for t in range(5, 12):
            logits = decode(m, idx[:, t : t + 1], cache)
            assert (logits - m(idx[:, : t + 1])[:, -1]).abs().max() < 1e-5, t
        # Zero tables: exactly the plain model with the same other weights, so ve is added to v.
        plain = build_model(tiny(n_layer=4, n_kv_head=2), seed=0).eval()
        plain.load_state_dict(
            {k: v for k, v in m.state_dict().items() if not k.startswith("value_embeds.")}
        )
        for table in m.value_embeds.values():
            table.weight.zero_()
        assert torch.equal(m(idx), plain(idx))
        assert (with_ve - plain(idx)).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="model.value_embed=True"):
        check_exportable(m.cfg)


def test_derived_mlp_hidden_is_a_multiple_of_256_from_1024_and_of_128_below():
    from codex.model.gpt import mlp_hidden

    assert mlp_hidden(ModelConfig()) == 384  # the default 4 x 128: 8/3 * 128 = 341 -> 384
    assert mlp_hidden(ModelConfig(n_embd=768)) == 2048  # 124m: already a multiple of 256
    assert mlp_hidden(ModelConfig(n_embd=1024)) == 2816  # 350m: 2730 -> 2816
    assert mlp_hidden(ModelConfig(n_embd=64, mlp="relu2")) == 256
    assert mlp_hidden(ModelConfig(n_embd=1024, mlp_hidden=1000)) == 1000  # an explicit size is kept
    for name in preset_names("model"):
        h = mlp_hidden(build_config(model=name).model)
        assert h % 256 == 0 or (h < 1024 and h % 128 == 0), (name, h)
