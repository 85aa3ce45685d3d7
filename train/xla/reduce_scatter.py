"""fsdp's weight-gradient reduction written out: each chip's partial gradient of a matmul weight
(its own tokens' dY^T X) reduce-scattered to the weight's sharding by explicit collectives in a
manual-sharding region, in phases: across the slice's hosts, then across one host's chips.

Why by hand: GSPMD writes the reduction as an all-reduce of the whole gradient and a slice, which
libtpu makes one reduce-scatter on v6e:2x2 and 2x4 but not on v6e:4x4 or v5p:2x2x4, where even an
explicit reduce-scatter over all 16 chips (JAX's psum_scatter too) is compiled as an all-reduce;
one over the hosts and one over a host's chips stay reduce-scatters. The layer loop's backward
uses it for each block matrix (train/xla/layer_scan.py), the head's backward for the head
(`head_forward`). docs/tpu.md, "Where the step's collectives run".
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from codex.train.xla.sharding import AXES, batch_spec, manual_sharding

# mesh -> the fsdp reduce-scatter's phases: the group sizes, outermost (the hosts) first
_PHASES = WeakIdKeyDictionary()


def set_phases(mesh, chips_per_host: int) -> None:
    """Reduce `mesh`'s fsdp gradients across the hosts, then across each host's chips, when an
    fsdp group spans several hosts of `chips_per_host` chips (device ids host by host); else in
    one reduce-scatter. A phase of more than 8 is split again (libtpu compiled 16 hosts' one as
    an all-reduce on v6e:8x8)."""
    shard = mesh.mesh_shape[AXES.index("fsdp")]
    split = 1 < chips_per_host < shard and shard % chips_per_host == 0
    sizes = (shard // chips_per_host, chips_per_host) if split else (shard,)
    _PHASES[mesh] = tuple(part for size in sizes for part in _at_most_8(size))


def _at_most_8(n: int) -> tuple[int, ...]:
    """`n` as the sizes of nested groups of at most 8, outermost first, near-square: 16 -> (4, 4),
    64 -> (8, 8); a size that no power of 2 divides stays whole."""
    if n <= 8 or n % 2:
        return (n,)
    inner = 2 ** math.ceil(math.log2(n) / 2)
    if n % inner:
        return (n,)
    return (*_at_most_8(n // inner), *_at_most_8(inner))


def phases(mesh) -> tuple[int, ...]:
    return _PHASES.get(mesh) or (mesh.mesh_shape[AXES.index("fsdp")],)


def reduced_weight_grad(
    a: torch.Tensor, b: torch.Tensor, mesh, spec: tuple, sizes: tuple[int, ...]
) -> torch.Tensor:
    """a^T b summed over every device's tokens, sharded as `spec` (a weight's partition spec,
    "fsdp" on one dim): a [N, m] and b [N, n] with the N tokens over every device (the batch
    sharding). Each device multiplies its own tokens, then reduce-scatters over each phase's
    groups (`sizes`: phases(mesh)) and, over several replicas, all-reduces the shard; in the
    operands' dtype. A weight sharded on its dim 1 gets b^T a scattered on dim 0, transposed
    after: libtpu kept a reduce-scatter on the minor dim whole on v5p:2x2x4 and v5e:4x4."""
    import torch_xla

    xla = torch_xla._XLAC
    if spec.index("fsdp") == 1:
        return reduced_weight_grad(b, a, mesh, spec[::-1], sizes).t()
    tokens = mesh.get_op_sharding(batch_spec(2))
    local = []
    for t in (a, b):
        t = t.clone()  # a value of its own to mark: the operand has other readers
        xla._xla_mark_sharding(t, tokens)
        local.append(xla._spmd_full_to_shard_shape(t))
    g = local[0].t() @ local[1]
    ids = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape)  # [replica, fsdp]
    for size, groups in _phase_groups(ids, sizes):
        g = xla._xla_spmd_reduce_scatter("sum", g, 1.0, 0, size, groups)
    if ids.shape[0] > 1:  # the replicas' shards: summed whole, as a replicated weight's
        g = xla._xla_spmd_all_reduce("sum", g, 1.0, ids.T.tolist())
    xla._mark_manual_sharding(g, manual_sharding())
    whole = (a.shape[1], b.shape[1])
    return xla._spmd_shard_to_full_shape(g, mesh.get_op_sharding(spec), whole, g.dtype)


def _phase_groups(ids: np.ndarray, sizes: tuple[int, ...]) -> list[tuple[int, list]]:
    """[(group size, replica groups)] of each phase: the fsdp index f = (i_0, i_1, ...) over
    `sizes`, phase k reducing over i_k with the others fixed, so that after the last phase each
    device keeps chunk f of the whole, as the weight's sharding places it."""
    out = []
    for k, size in enumerate(sizes):
        per_replica = ids.reshape(ids.shape[0], *sizes)
        groups = np.moveaxis(per_replica, k + 1, -1).reshape(-1, size)
        out.append((size, groups.tolist()))
    return out


class WeightGradReducer(torch.nn.Module):
    """reduced_weight_grad for one weight, as a module the layer loop's backward graph calls in
    place of the gradient's matmul (a module: an FX graph calls it by name); on fake tensors
    (the graph's trace) the plain product."""

    def __init__(self, mesh, spec: tuple):
        super().__init__()
        # the phases read now: the graph module holding this one may be deep-copied, its mesh too
        self.mesh, self.spec, self.sizes = mesh, spec, phases(mesh)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if is_fake(a):
            return a.t() @ b
        return reduced_weight_grad(a, b, self.mesh, self.spec, self.sizes)


class _Head(torch.autograd.Function):
    """The output head h @ W^T whose weight gradient dlogits^T h is reduced by
    reduced_weight_grad (W [V, C] sharded on its width C: scattered as its transpose)."""

    @staticmethod
    def forward(ctx, h, weight, mesh, spec):
        logits = F.linear(h, weight)  # in autocast's dtype when it is on
        ctx.save_for_backward(h, weight)
        ctx.mesh, ctx.spec, ctx.sizes = mesh, spec, phases(mesh)
        return logits

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        dtype = grad.dtype
        grad_h = (grad @ weight.to(dtype)).to(h.dtype)
        flat_h = h.reshape(-1, h.shape[-1]).to(dtype)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_w = reduced_weight_grad(flat_grad, flat_h, ctx.mesh, ctx.spec, ctx.sizes)
        return grad_h, grad_w.to(weight.dtype), None, None


def head_forward(head: torch.nn.Linear, mesh, spec: tuple, h: torch.Tensor) -> torch.Tensor:
    """`head`'s forward under fsdp's traced step: its weight gradient reduced by hand."""
    return _Head.apply(h, head.weight, mesh, spec)
