"""torch_xla's Pallas flash-attention kernel for the model's attention on TPU
(model.attention=flash, and auto on a TPU with JAX), and which attention the XLA backend runs
(`xla_attention`).

Under XLA, SDPA lowers to its math form, whose [B, H, T, T] scores dominate memory from
T ~ 2048; the kernel streams K/V blocks through VMEM instead. XLABackend.prepare_model installs
it (use_flash_attention): every block's attention then calls flash_attend. The block sizes per
chip, SPMD, GQA and where it is refused: docs/tpu.md, "Flash attention on TPU".
"""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING, cast

import torch

from codex.model.attention import attention_kind, blockwise_causal
from codex.train.xla.sharding import tracing_per_device

if TYPE_CHECKING:
    from codex.model.gpt import GPT

REQUIREMENT = (
    "model.attention=flash runs torch_xla's Pallas flash-attention kernel, "
    "which needs a TPU preset "
    "(e.g. --hardware v6e-4) on a TPU VM with PJRT_DEVICE=TPU"
)


def flash_unavailable(found: str) -> str:
    """The one-line refusal off a TPU; `found` says what this run has instead."""
    return (
        f"{REQUIREMENT}, but {found}. "
        "Fix: leave model.attention at auto (the default: the backend's kernel), "
        "or --set model.attention=sdpa, or run on a TPU VM."
    )


def pallas_available(platform: str) -> bool:
    """The Pallas kernel can run: a real TPU (it is a TPU custom call) and JAX installed
    (torch_xla traces the kernel with it at the first forward)."""
    return platform == "TPU" and importlib.util.find_spec("jax") is not None


def xla_attention(requested: str, platform: str) -> str:
    """The attention the XLA backend runs on `platform` ("TPU" or "CPU", train/xla/platform.py:
    check_platform) for model.attention=`requested`: "flash" (installed by use_flash_attention),
    "blockwise" or "sdpa" (the model's own, model/attention.py)."""
    return attention_kind(requested, "xla", pallas=pallas_available(platform))


# Block sizes of the Pallas kernel (jax.experimental.pallas.ops.tpu.flash_attention.BlockSizes) per
# chip, as torch_xla's tpu.get_tpu_type names it (the accelerator type's prefix: v6e-4 -> v6e).
# DEFAULT: torch_xla 2.9's FlashAttention.DEFAULT_BLOCK_SIZES, which it copied from MaxText's
# flash block sizes (google/maxtext 0fee320, MaxText/layers/attentions.py) for this same kernel;
# MaxText's benchmark configs (AI-Hypercomputer/maxtext e591f30) keep base.yml's 512 blocks
# (sa_block_*) on v5e at 2048-token sequences (benchmarks/maxtext_v5e_model_configs.py) and on
# v5p up to 4096 (maxtext_v5p_model_configs.py; 2048 only at 8192), so v5e, v5p and v4 use these.
# v6e: MaxText's Trillium dense configs at 2048 tokens (benchmarks/
# maxtext_trillium_model_configs.py, default-32 and default-64) raise the query blocks to 1024
# forward and dkv, 2048 for dq, keys at 512 (sa_block_q, sa_block_q_dkv, sa_block_q_dq of its
# splash kernel; the same roles here).
DEFAULT_BLOCK_SIZES = {
    "block_q": 512,
    "block_k_major": 512,
    "block_k": 512,
    "block_b": 2,
    "block_q_major_dkv": 512,
    "block_k_major_dkv": 512,
    "block_q_dkv": 512,
    "block_k_dkv": 512,
    "block_q_dq": 1024,
    "block_k_dq": 256,
    "block_k_major_dq": 512,
}
BLOCK_SIZES = {
    "v6e": {
        **DEFAULT_BLOCK_SIZES,
        "block_q": 1024,
        "block_q_major_dkv": 1024,
        "block_q_dkv": 1024,
        "block_q_dq": 2048,
    },
}
# the kernel's tiles: a key block is a multiple of 128 lanes unless it spans the whole sequence
LANES = 128


def _fit(block: int, seq_len: int) -> int:
    """The largest of block, block / 2, ... (down to LANES) that divides seq_len; seq_len itself
    when it is shorter than block or no such multiple of LANES divides it. The kernel tiles the
    queries without padding them and needs each minor block to divide its major one."""
    if seq_len <= block:
        return seq_len
    b = block
    while b > LANES and seq_len % b:
        b //= 2
    return b if seq_len % b == 0 else seq_len


def flash_block_sizes(chip: str, seq_len: int) -> dict[str, int]:
    """The kernel's block sizes for `chip` (BLOCK_SIZES' keys; others get DEFAULT_BLOCK_SIZES)
    at `seq_len` positions, each fitted to the sequence (_fit). block_b (sequences per kernel
    step) is kept: the kernel's grid rounds the batch up to it and torch_xla caps it at the
    batch."""
    table = BLOCK_SIZES.get(chip, DEFAULT_BLOCK_SIZES)
    return {k: b if k == "block_b" else _fit(b, seq_len) for k, b in table.items()}


def tpu_chip() -> str:
    """This TPU VM's chip, as its accelerator type names it (v6e, v5litepod, v5p, v4); "" when
    torch_xla cannot tell (then DEFAULT_BLOCK_SIZES apply)."""
    try:
        from torch_xla._internal import tpu

        return str(tpu.get_tpu_type())
    except Exception:  # no TPU metadata (not a TPU VM), or torch_xla internals moved
        return ""


def expand_kv_heads(kv: torch.Tensor, n_head: int) -> torch.Tensor:
    """kv [B, n_kv_head, T, D] -> [B, n_head, T, D] where head h is kv head
    h // (n_head / n_kv_head) (each K/V head repeated for its group of consecutive query heads);
    unchanged when equal."""
    B, n_kv, T, D = kv.shape
    if n_kv == n_head:
        return kv
    return kv[:, :, None].expand(B, n_kv, n_head // n_kv, T, D).reshape(B, n_head, T, D)


def flash_partition_spec(mesh_axis_names: tuple[str, ...] | None) -> tuple | None:
    """The kernel's partition spec for q, k, v [B, H, T, D]: the batch sharded over the mesh's
    axes (every axis of codex's mesh is data-parallel), heads, positions and head dim whole on
    each chip. None without a mesh (spawn mode: each process holds its own batch)."""
    if not mesh_axis_names:
        return None
    batch = mesh_axis_names[0] if len(mesh_axis_names) == 1 else tuple(mesh_axis_names)
    return (batch, None, None, None)


def make_flash_attend(mesh, chip: str | None = None):
    """attend(q, k, v) -> y [B, H, T, D], causal, through the Pallas kernel (TPU only), with the
    block sizes of `chip` (None: this VM's, tpu_chip)."""
    from torch_xla.experimental.custom_kernel import FlashAttention, flash_attention

    spec = flash_partition_spec(tuple(mesh.axis_names) if mesh is not None else None)
    chip = tpu_chip() if chip is None else chip

    def flash_attend(q, k, v):
        if q.shape[2] < LANES:
            # the kernel tiles keys in blocks of LANES: a shorter sequence fails its trace (seen
            # compiling for v6e at T = 64: "sub got incompatible shapes (64, 64), (64, 0)")
            return blockwise_causal(q, k, v)
        n_head, head_dim = q.shape[1], q.shape[-1]
        k, v = expand_kv_heads(k, n_head), expand_kv_heads(v, n_head)
        # read by the kernel's tracing, forward and backward (see the module docstring)
        FlashAttention.DEFAULT_BLOCK_SIZES.update(flash_block_sizes(chip, q.shape[2]))
        local = tracing_per_device()
        # The kernel's default scale is 1.0; SDPA's (and the model's) is 1/sqrt(head_dim).
        return flash_attention(
            q,
            k,
            v,
            causal=True,
            sm_scale=1.0 / math.sqrt(head_dim),
            partition_spec=None if local else spec,
            mesh=None if local else mesh,
        )

    return flash_attend


def use_flash_attention(model: torch.nn.Module, mesh, chip: str | None = None) -> None:
    """Every block's attention of `model` (a GPT, on its XLA device) through the flash kernel,
    with the block sizes of `chip` (None: this VM's)."""
    cast("GPT", model).set_attention(make_flash_attend(mesh, chip))


# The newest Mosaic IR libtpu 0.0.21 (torch_xla 2.9's tpu extra, pinned by tpu-aot) deserializes:
# JAX 0.7.1 writes 8 unless told, and that libtpu refuses it ("expected <= 7 but got 8").
MOSAIC_IR_VERSION = 7


def lower_pallas_for_tpu() -> None:
    """Have torch_xla trace its Pallas kernels for the TPU on a host without one (`codex train
    --compile-only`). torch_xla 2.9's trace_pallas lowers the kernel with JAX's default backend,
    the CPU there, where Pallas only interprets ("Only interpret mode is supported on CPU
    backend"); the same lowering asked for the "tpu" platform gives the kernel's tpu_custom_call,
    whose payload torch_xla puts in the graph as it does on a TPU. Replaces
    custom_kernel.trace_pallas (which its kernels call by that name) for this process."""
    import jax
    from jax._src import tpu_custom_call
    from jax.experimental.pallas import tpu  # noqa: F401  (Pallas' TPU lowering, in import order)
    from torch_xla.experimental import custom_kernel

    # JAX serializes the kernel in the newest Mosaic IR unless a TPU backend says its libtpu is
    # older; here there is none, and the compiler that reads it is tpu-aot's libtpu
    tpu_custom_call.get_ir_version = lambda _ctx: MOSAIC_IR_VERSION

    def trace_pallas(kernel, *args, static_argnums=None, static_argnames=None, **kwargs):
        kwargs.pop("use_cache", None)
        jax_args = [
            custom_kernel.to_jax_shape_dtype_struct(a) if torch.is_tensor(a) else a for a in args
        ]
        jitted = jax.jit(kernel, static_argnums=static_argnums, static_argnames=static_argnames)
        lowered = jitted.trace(*jax_args, **kwargs).lower(lowering_platforms=("tpu",))
        payload = custom_kernel._extract_backend_config(lowered.compiler_ir())
        return payload, [a for a in args if torch.is_tensor(a)]

    custom_kernel.trace_pallas = trace_pallas
