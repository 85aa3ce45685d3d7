"""model.attention (model/attention.py, train/xla/flash.py, train/xla/platform.py): what can run
off a TPU. The one rule (attention_kind, xla_attention); blockwise attention against SDPA, forward
and backward, with block sizes that do and do not divide T and with GQA, and that it holds no
[.., T, T] tensor; the GQA head mapping of the flash path, its SPMD partition spec, its block sizes
per chip, the model's kernel hook, and the refusal of model.attention=flash on a CPU preset (the
XLA CPU backend's refusal is in tests/train/xla/test_xla.py, NO_FALLBACK); libtpu's flags on the
TPU path.
The Pallas kernel itself runs only on a TPU: not tested here. The compiled XLA step's buffers are
read in tests/train/xla/test_xla_attention.py."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from codex.core.config import build_config
from codex.core.config.model import ModelConfig
from codex.model.attention import attention_kind, blockwise_causal, default_block
from codex.model.gpt import build_model, sdpa_causal
from codex.train.distributed.backend import BackendError
from codex.train.plan.presets import get_preset
from codex.train.xla import flash, platform
from codex.train.xla.flash import (
    BLOCK_SIZES,
    DEFAULT_BLOCK_SIZES,
    REQUIREMENT,
    expand_kv_heads,
    flash_block_sizes,
    flash_partition_spec,
    xla_attention,
)
from tests.fixtures.runs import base_overrides, child_env, make_run

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
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


@pytest.mark.slow
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


# --- the one rule ------------------------------------------------------------------------------


def test_auto_is_the_default_and_picks_by_device():
    assert ModelConfig().attention == "auto"
    assert attention_kind("auto", "cuda") == attention_kind("auto", "cpu") == "sdpa"
    assert attention_kind("auto", "xla") == "blockwise"
    assert attention_kind("auto", "xla", pallas=True) == "flash"
    for kind in ("sdpa", "flash", "blockwise"):  # an explicit choice is kept everywhere
        assert attention_kind(kind, "cuda") == attention_kind(kind, "xla", pallas=True) == kind
    with pytest.raises(ValueError, match="model.attention"):
        attention_kind("math", "cpu")


def test_xla_backend_runs_flash_only_where_pallas_can(monkeypatch):
    assert xla_attention("auto", "CPU") == "blockwise"  # the XLA CPU backend: no Pallas
    monkeypatch.setattr(flash, "pallas_available", lambda p: p == "TPU")  # a TPU VM with JAX
    assert xla_attention("auto", "TPU") == "flash" and xla_attention("auto", "CPU") == "blockwise"
    assert (
        xla_attention("sdpa", "TPU") == "sdpa" and xla_attention("blockwise", "TPU") == "blockwise"
    )
    monkeypatch.setattr(flash, "pallas_available", lambda p: False)  # a TPU VM without JAX
    assert xla_attention("auto", "TPU") == "blockwise"


def test_the_model_runs_sdpa_off_xla_under_auto():
    """On the CPU (and CUDA) auto is SDPA itself: the same logits, bit for bit."""
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=300, max_seq_len=32)
    idx = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        auto = build_model(cfg, seed=0)(idx)
        sdpa = build_model(dataclasses.replace(cfg, attention="sdpa"), seed=0)(idx)
    assert torch.equal(auto, sdpa)


# --- blockwise attention -----------------------------------------------------------------------


def _qkv(B, H, KV, T, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, h, T, D, generator=g, dtype=dtype).requires_grad_() for h in (H, KV, KV)
    )


def _grads(fn, q, k, v, dout):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize(
    "T, block_q, block_k, H, KV",
    [
        (64, 16, 16, 4, 4),  # blocks divide T, MHA
        (64, 16, 16, 8, 2),  # GQA: 4 query heads per K/V head
        (100, 32, 32, 6, 3),  # the last block shorter
        (100, 16, 48, 4, 1),  # query and key blocks of different sizes, neither dividing T
        (257, 64, 0, 4, 2),  # key block default_block(257)
        (7, 0, 0, 2, 1),  # one block: shorter than the smallest default block
        (1, 0, 0, 2, 2),
    ],
)
def test_blockwise_equals_sdpa_forward_and_backward(T, block_q, block_k, H, KV):
    q, k, v = _qkv(2, H, KV, T, 16)
    dout = torch.randn(2, H, T, 16, generator=torch.Generator().manual_seed(9))
    got = _grads(lambda a, b, c: blockwise_causal(a, b, c, block_q, block_k), q, k, v, dout)
    want = _grads(sdpa_causal, q, k, v, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        err = (g - w).abs().max().item()
        assert err <= 2e-6 * max(1.0, w.abs().max().item()), (name, err)


def test_blockwise_gradients_pass_gradcheck_in_fp64():
    q, k, v = _qkv(1, 4, 2, 13, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b, c: blockwise_causal(a, b, c, 4, 3), (q, k, v))


def test_blockwise_under_bf16_autocast_keeps_fp32_statistics():
    """Under autocast q, k, v arrive in bf16; the scores and softmax stay fp32 inside (as SDPA's
    math path), the output is bf16 and as close to fp32 attention as SDPA's bf16 output is."""
    q, k, v = (t.detach() for t in _qkv(2, 4, 2, 96, 32))
    ref = sdpa_causal(q, k, v)
    low = [t.bfloat16() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = blockwise_causal(*low, 32, 32)
    assert got.dtype == torch.bfloat16
    sdpa_err = (sdpa_causal(*low).float() - ref).abs().max().item()
    assert (got.float() - ref).abs().max().item() <= 1.5 * sdpa_err + 1e-3


class _Shapes(TorchDispatchMode):
    """Every tensor shape an op produces while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _square(shapes, T):
    return [s for s in shapes if len(s) >= 2 and min(s[-2:]) >= T]


def test_blockwise_never_makes_a_t_by_t_tensor():
    """Every tensor blockwise attention makes, forward and backward, is at most a block of
    scores; SDPA's math path, under the same check, makes [B, H, T, T]: the check can fail."""
    T = 128
    assert default_block(T) == 32
    q, k, v = _qkv(2, 4, 2, T, 16)
    with _Shapes() as seen:
        blockwise_causal(q, k, v).sum().backward()
    assert seen.shapes and not _square(seen.shapes, T)
    # the scores of one query block against one key block: [B, KV, group x 32 rows, 32 keys]
    assert (2, 2, 2 * 32, 32) in seen.shapes

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with _Shapes() as math, sdpa_kernel(SDPBackend.MATH):
        sdpa_causal(q, k, v).sum().backward()
    assert (2, 4, T, T) in _square(math.shapes, T)


def test_default_blocks_are_four_to_eight_per_sequence():
    assert [default_block(t) for t in (16, 64, 256, 512, 1024, 2048, 4096, 8192)] == [
        16,
        16,
        64,
        128,
        256,
        512,
        512,
        1024,
    ]


def test_a_blockwise_model_gives_the_sdpa_models_logits_and_gradients():
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=300, max_seq_len=64)
    idx = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(1))
    models = [
        build_model(dataclasses.replace(cfg, attention=a), seed=0) for a in ("sdpa", "blockwise")
    ]
    losses = [m(idx, idx) for m in models]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) < 1e-5
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert (a.grad - b.grad).abs().max().item() < 1e-5, name


# --- flash's block sizes -----------------------------------------------------------------------


def test_flash_block_sizes_per_chip():
    v6e, v5e = flash_block_sizes("v6e", 2048), flash_block_sizes("v5litepod", 2048)
    assert v5e == DEFAULT_BLOCK_SIZES == flash_block_sizes("v5p", 2048)
    assert v6e == BLOCK_SIZES["v6e"] and v6e["block_q"] == 1024 and v6e["block_q_dq"] == 2048
    assert flash_block_sizes("", 2048) == DEFAULT_BLOCK_SIZES  # chip unknown


@pytest.mark.parametrize("T", [128, 256, 384, 1000, 1024, 1536, 2048, 8192])
@pytest.mark.parametrize("chip", ["v6e", "v5litepod"])
def test_flash_block_sizes_fit_the_sequence(chip, T):
    """Each block divides T (the kernel does not pad the queries), a key block is a multiple of
    128 lanes or the whole sequence, and each minor block divides its major one (the kernel's
    BlockSizes checks)."""
    b = flash_block_sizes(chip, T)
    for name, size in b.items():
        if name != "block_b":
            assert T % size == 0 and size <= T, (name, size)
    for name in ("block_k", "block_k_dkv", "block_k_dq"):
        assert b[name] % 128 == 0 or b[name] == T, (name, b[name])
    for major, minor in [
        ("block_k_major", "block_k"),
        ("block_k_major_dkv", "block_k_dkv"),
        ("block_q_major_dkv", "block_q_dkv"),
        ("block_k_major_dq", "block_k_dq"),
    ]:
        assert b[major] % b[minor] == 0, (major, minor, b)


# --- libtpu's flags ----------------------------------------------------------------------------


def test_libtpu_flags_are_added_and_a_users_value_wins():
    ours = platform.LIBTPU_FLAGS
    assert "--xla_tpu_enable_async_collective_fusion=true" in ours
    assert platform.libtpu_init_args("").split() == list(ours)
    user = "--xla_enable_async_all_gather=false --xla_tpu_scoped_vmem_limit_kib=98304"
    merged = platform.libtpu_init_args(user).split()
    assert merged[:2] == user.split()  # the user's string first, as given
    assert "--xla_enable_async_all_gather=true" not in merged
    assert sorted(merged[2:]) == sorted(f for f in ours if "async_all_gather=" not in f)


def test_v6e_gets_maxtexts_chip_flags_and_a_users_value_wins():
    """v6e: scoped VMEM and the all-reduce-scatter layout beside the async-collective flags;
    other chips (v5p's MaxText extra, data-parallel overlap, changes nothing on one slice): the
    async flags alone."""
    v6e = platform.libtpu_init_args("", "v6e").split()
    assert v6e[: len(platform.LIBTPU_FLAGS)] == list(platform.LIBTPU_FLAGS)
    assert "--xla_tpu_scoped_vmem_limit_kib=98304" in v6e
    assert "--xla_tpu_assign_all_reduce_scatter_layout=true" in v6e
    for chip in ("v5p", "v5e", "v4", ""):
        assert platform.libtpu_init_args("", chip).split() == list(platform.LIBTPU_FLAGS)
    user = "--xla_tpu_scoped_vmem_limit_kib=65536"
    merged = platform.libtpu_init_args(user, "v6e").split()
    assert merged[0] == user and not [a for a in merged[1:] if "scoped_vmem" in a]


def test_the_tpu_path_sets_libtpu_flags_before_importing_torch_xla(monkeypatch):
    """check_platform on PJRT_DEVICE=TPU (here it then fails: no torch_xla, or no TPU) has put the
    flags into the environment first, keeping the user's."""
    user = "--xla_tpu_enable_async_collective_fusion_multiple_steps=false"
    env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
    monkeypatch.setattr(os, "environ", {**env, "PJRT_DEVICE": "TPU", "LIBTPU_INIT_ARGS": user})
    cfg = build_config(overrides=["train.hardware=v6e-4"])
    with pytest.raises(BackendError):
        platform.check_platform(cfg, get_preset("v6e-4"))
    args = os.environ["LIBTPU_INIT_ARGS"].split()
    assert args[0] == user and "--xla_tpu_enable_async_collective_fusion=true" in args
    assert len(args) == len(platform.libtpu_flags("v6e"))  # ours, less the one the user set
    assert "--xla_tpu_scoped_vmem_limit_kib=98304" in args  # v6e-4's chip flags too
    monkeypatch.setattr(os, "environ", {**env, "PJRT_DEVICE": "CPU"})
    with pytest.raises(BackendError):
        platform.check_platform(cfg, get_preset("v6e-4"))
    assert "LIBTPU_INIT_ARGS" not in os.environ  # only the TPU path sets them
