"""`model.attention=flash`: torch_xla's Pallas flash-attention kernel for the model's attention on
TPU.

Why: under XLA, SDPA lowers to its math decomposition, which materialises the [B, H, T, T]
scores (fp32 under autocast) and dominates memory from T ~ 2048. The Pallas kernel
(torch_xla.experimental.custom_kernel.flash_attention) streams K/V blocks through VMEM instead.

    XLABackend.prepare_model -> use_flash_attention(model, mesh)
        every block's attention calls flash_attend(q, k, v) instead of SDPA

SPMD: the kernel runs per chip through shard_map, so it needs the partition spec of q, k, v
[B, H, T, D] (flash_partition_spec: the batch sharded over the mesh, the rest whole) and the mesh.
spawn (one process per chip), and the cached step's per-device While under replicate
(train/xla/step.py traces its body inside `per_device_trace()`): no mesh, no spec, q, k, v are
already one chip's.

GQA: the kernel indexes K/V with the query's head index, so it needs as many K/V heads as query
heads; grouped K/V heads are repeated to n_head on this path only (expand_kv_heads: a [B, H, T, D]
copy per layer in the compute dtype, far smaller than the [B, H, T, T] scores it replaces).
Query head h reads K/V head h // (n_head / n_kv_head), as SDPA's enable_gqa does.

Only on a TPU: the kernel is a TPU custom call, so a CPU or CUDA preset, or the XLA path on
PJRT_DEVICE=CPU, refuses model.attention=flash before the run starts (flash_unavailable).
Not yet run on a TPU: sdpa stays the default until it has been.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch

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
        "Fix: --set model.attention=sdpa (the default), or run on a TPU VM."
    )


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


def make_flash_attend(mesh):
    """attend(q, k, v) -> y [B, H, T, D], causal, through the Pallas kernel (TPU only)."""
    from torch_xla.experimental.custom_kernel import flash_attention

    spec = flash_partition_spec(tuple(mesh.axis_names) if mesh is not None else None)

    def flash_attend(q, k, v):
        n_head, head_dim = q.shape[1], q.shape[-1]
        k, v = expand_kv_heads(k, n_head), expand_kv_heads(v, n_head)
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


def use_flash_attention(model: torch.nn.Module, mesh) -> None:
    """Every block's attention of `model` (a GPT, on its XLA device) through the flash kernel."""
    cast("GPT", model).set_attention(make_flash_attend(mesh))
