"""The sharded layout (train.parallel=fsdp) on CPU and CUDA: FSDP2 over a DeviceMesh.

    layout = layout_for("fsdp", fsdp_size, world_size)   # train/plan/layout.py
    model = build_sharded(cfg.model, seed, layout, device, compute_dtype, compile)

Weights, gradients and optimizer state are DTensors sharded on dim 0 over `shard` ranks
(`fully_shard` per transformer block, then the root: wte, norm_f, lm_head). With replicas > 1
the mesh is 2-D (replicas x shard): HSDP, the state replicated across groups of `shard` ranks.
Each block's full weights exist only between its all-gather and its reshard: after its forward
(`layout.reshard_after_forward`, ZeRO-3) or, where the memory plan fits them
(train/plan/memory.py chose False, ZeRO-2), after its backward, so that the backward gathers
nothing. The last block always keeps its weights to the backward (torchtitan does the same: the
backward would gather it again at once); the root keeps its weights too (FSDP2's default for it).

The model is built on the meta device, sharded, then materialised with to_empty and initialised
one parameter at a time: the full tensor of that one parameter is drawn on the CPU from the same
generator stream as model/gpt.py's build_model (model.gpt.init_parameter, same order), and each
rank keeps its slice. So the sharded model holds exactly the weights of the replicated one
(bitwise), and no process ever holds more than one full parameter.

Precision: under bf16 the MixedPrecisionPolicy gathers bf16 copies of the fp32 master shards and
casts each block's floating-point inputs to bf16, so the model computes in bf16 without autocast
(TorchBackend.autocast is a null context under fsdp, as torchtitan's maybe_enable_amp). The ops
torch's autocast would run in fp32 get bf16 inputs either way: the residual stream is bf16 under
autocast too (GPT.embed), RMSNorm accumulates in fp32 itself and the cross-entropy upcasts the
logits. With train.compile (CUDA) each block's forward and GPT.head_loss (the final norm, the head
and the cross-entropy) are compiled, each as one function inside FSDP2's hooks.

Gradient reduction: FSDP2 reduce-scatters (averages) each block's gradient inside backward. Under
gradient accumulation `set_grad_sync(model, last)` turns that off for all but the last
micro-batch, so there is still one gradient reduction per optimizer step (the unsharded
gradients accumulate locally in between).
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
