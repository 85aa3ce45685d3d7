"""The sharded layout (train.parallel=fsdp) on CPU and CUDA: FSDP2 over a DeviceMesh.

    layout = layout_for("fsdp", fsdp_size, world_size)   # train/plan/layout.py
    model = build_sharded(cfg.model, seed, layout, device, compute_dtype, compile)

Weights, gradients and optimizer state are DTensors sharded on dim 0 over `shard` ranks
(`fully_shard` per transformer block, then the root: wte, norm_f, lm_head). With replicas > 1
the mesh is 2-D (replicas x shard): HSDP, the state replicated across groups of `shard` ranks.
Each block's full weights exist only between its all-gather and its reshard.

The model is built on the meta device, sharded, then materialised with to_empty and initialised
one parameter at a time: the full tensor of that one parameter is drawn on the CPU from the same
generator stream as model/gpt.py's build_model (model.gpt.init_parameter, same order), and each
rank keeps its slice. So the sharded model holds exactly the weights of the replicated one
(bitwise), and no process ever holds more than one full parameter.

Gradient reduction: FSDP2 reduce-scatters (averages) each block's gradient inside backward. Under
gradient accumulation `set_grad_sync(model, last)` turns that off for all but the last
micro-batch, so there is still one gradient reduction per optimizer step (the unsharded
gradients accumulate locally in between).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from model.gpt import GPT, init_parameter, rope_cache
from train.plan.layout import Layout

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def make_mesh(layout: Layout, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    if layout.replicas > 1:
        return init_device_mesh(
            device_type, (layout.replicas, layout.shard), mesh_dim_names=("replicate", "shard")
        )
    return init_device_mesh(device_type, (layout.shard,), mesh_dim_names=("shard",))


def build_sharded(
    model_cfg,
    seed: int,
    layout: Layout,
    device: torch.device,
    compute_dtype: torch.dtype | None,
    compile_blocks: bool,
) -> GPT:
    """The GPT of build_model(model_cfg, seed), sharded over `layout`'s mesh on `device`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = GPT(model_cfg)
    mesh = make_mesh(layout, device.type)
    # bf16 compute: blocks all-gather bf16 copies of the fp32 master shards; gradients are reduced
    # in fp32. fp32 compute: no policy (params, compute and reduction all fp32).
    mp = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype is not None
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        if compile_blocks:
            # The block's forward only: FSDP's hooks stay outside the compiled region, and the
            # parameter names (checkpoint keys) get no '_orig_mod.' (unverified on a GPU here).
            block.forward = torch.compile(block.forward)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    init_sharded(model, seed)
    return model


@torch.no_grad()
def init_sharded(model: GPT, seed: int) -> None:
    """Each rank's slices of build_model's weights, drawn one full parameter at a time."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    for name, p in model.named_parameters():  # the order GPT.init_weights draws in
        full = torch.empty(p.shape, dtype=p.dtype)
        init_parameter(model.cfg, name, full, generator)
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank slices its own copy, no communication.
            part = distribute_tensor(
                full, p.device_mesh, p.placements, src_data_rank=None
            ).to_local()
            p.to_local().copy_(part)
        else:
            p.copy_(full)
    cos, sin = rope_cache(
        model.cfg.max_seq_len, model.cfg.n_embd // model.cfg.n_head, model.cfg.rope_theta
    )
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)


def set_grad_sync(model: torch.nn.Module, on: bool) -> None:
    """Reduce-scatter gradients in this backward (on) or accumulate them unsharded (off)."""
    cast("FSDPModule", model).set_requires_gradient_sync(on)  # fully_shard made it one
