"""The sharded layout (train.parallel=fsdp) on CPU and CUDA: FSDP2 over a DeviceMesh.

    layout = layout_for("fsdp", fsdp_size, world_size)   # train/plan/layout.py
    model = build_sharded(cfg.model, seed, layout, device, compute_dtype, compile)

`fully_shard` per block, then the root (wte, norm_f, lm_head); replicas > 1: HSDP over a 2-D
mesh. The model is built on the meta device and initialised one parameter at a time, each rank
keeping its slice: bitwise the replicated weights. ZeRO-2 or ZeRO-3, the precision policy, the
compiled head and the one reduction per step: docs/cuda.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from codex.model.gpt import GPT, init_parameter, rope_cache
from codex.train.plan.layout import Layout

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
    reduce_dtype: torch.dtype = torch.float32,
) -> GPT:
    """The GPT of build_model(model_cfg, seed), sharded over `layout`'s mesh on `device`.
    7 parameters: the model's config and seed, the layout and device, and the backend's three
    settings for it (compute dtype, compile, train.reduce_dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = GPT(model_cfg)
    mesh = make_mesh(layout, device.type)
    # bf16 compute: blocks all-gather bf16 copies of the fp32 master shards (fp32: no cast).
    # Gradients are reduce-scattered in train.reduce_dtype (fp32 by default; bf16 also accumulates
    # the micro-batches' unsharded gradients in bf16) into the fp32 gradient shards.
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        if compile_blocks:
            # The block's forward only: FSDP's hooks stay outside the compiled region, and the
            # parameter names (checkpoint keys) get no '_orig_mod.' (unverified on a GPU here).
            block.forward = torch.compile(block.forward, fullgraph=True)
        # False: ZeRO-2, the plan's choice where it fits; the last block's backward runs first
        reshard = layout.reshard_after_forward and i < last
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    if compile_blocks:
        compile_head(model)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    init_sharded(model, seed)
    return model


def compile_head(model: GPT) -> None:
    """torch.compile GPT.head_loss (final norm, head, cross-entropy: the fp32 logits fused into the
    loss) on this model only, as an instance attribute: no wrapper module, so the state_dict keys
    get no '_orig_mod.'. The forward calls it inside the root's FSDP2 hooks, on gathered weights."""
    model.head_loss = torch.compile(model.head_loss, fullgraph=True)  # type: ignore[method-assign]


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
