"""train.parallel=fsdp under XLA SPMD: where every tensor of the training state lives on the mesh.

    mesh = make_mesh(layout.replicas, layout.shard)        # 2-D: ("replica", "fsdp")
    model = shard_model(build_model(cfg, seed), mesh, device)

Each parameter is sharded on its planned dim (`model_specs`: the embedding tables and the head on
their width, the other matrices on a dim that is not the width) and sent to the devices already
sharded; the optimizer state takes its parameter's sharding (global step hooks); every
Linear/Embedding output is constrained to the batch sharding. Each mark is asserted. The layout
and why: docs/tpu.md, "Sharded training on TPU".
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from codex.model.gpt import STACKED

AXES = ("replica", "fsdp")
BATCH_AXES = ("replica", "fsdp")  # dim 0 of a batch or an activation: over every device

# parameter -> (mesh, partition spec, the sharding string the runtime reports for it)
_PLANNED = WeakIdKeyDictionary()
_CHECKED = WeakIdKeyDictionary()  # optimizer state tensors already carrying their sharding
_HOOKS: list = []


_PER_DEVICE = contextvars.ContextVar("codex_xla_per_device", default=False)


@contextlib.contextmanager
def per_device_trace():
    """Inside: the model is traced on one device's tensors under manual sharding (the cached
    step's While, train/xla/step.py), so nothing may annotate a global sharding: the output
    constraints below and the flash kernel's mesh stand aside."""
    token = _PER_DEVICE.set(True)
    try:
        yield
    finally:
        _PER_DEVICE.reset(token)


def tracing_per_device() -> bool:
    return _PER_DEVICE.get()


_FAKE = contextvars.ContextVar("codex_xla_fake_trace", default=False)


@contextlib.contextmanager
def fake_trace():
    """Inside: the model runs on fake tensors (AOTAutograd tracing one scanned layer,
    train/xla/layer_scan.py), which carry no sharding: the output constraints below stand aside."""
    token = _FAKE.set(True)
    try:
        yield
    finally:
        _FAKE.reset(token)


def planned_spec(p: torch.Tensor) -> tuple | None:
    """The partition spec shard_model gave parameter `p`, or None (not planned)."""
    planned = _PLANNED.get(p)
    return None if planned is None else planned[1]


def annotate(t: torch.Tensor, mesh, spec: tuple) -> None:
    """A sharding constraint on `t`'s value (a Sharding custom-call in the HLO), in place."""
    import torch_xla

    torch_xla._XLAC._xla_annotate_custom_sharding(t, mesh.get_op_sharding(spec))


@functools.cache
def manual_sharding():
    """torch_xla's OpSharding of type MANUAL (made on first use: torch_xla is imported late)."""
    import torch_xla
    from torch_xla.distributed.spmd import ShardingType

    return torch_xla._XLAC.OpSharding([], [], [], ShardingType.MANUAL)


def make_mesh(replicas: int, shard: int):
    """The (replica, fsdp) mesh over every device of the slice, device ids row by row."""
    import torch_xla.distributed.spmd as xs

    return xs.Mesh(np.arange(replicas * shard), (replicas, shard), AXES)


def param_spec(shape: tuple[int, ...], shard: int, first: int | None = None) -> tuple:
    """The partition spec of a parameter of `shape` over `shard` fsdp devices: its dim `first`
    when given and the fsdp size divides it, else its first dim that it divides, else
    replicated."""
    spec: list[str | None] = [None] * len(shape)
    if shard > 1:
        dims = list(range(len(shape)))
        if first is not None:
            dims.insert(0, dims.pop(first % len(shape)))
        for dim in dims:
            if shape[dim] % shard == 0:
                spec[dim] = "fsdp"
                break
    return tuple(spec)


def model_specs(model: torch.nn.Module, shard: int) -> dict[str, tuple]:
    """{parameter name: partition spec} of every parameter of `model` over `shard` fsdp devices
    (a tied weight under its first name). Why each rule: docs/tpu.md, "Sharded training on TPU".

    - An embedding table and the output head (`model.lm_head`, tied or not) on their width: the
      lookup then gives each chip a slice of every token's vector, moved to the chip that holds
      the token by an all-to-all of one chip's tokens. On the vocabulary, each chip looks up the
      whole global batch in its rows and the partitioner all-reduces [global tokens, width].
    - Any other matrix on its first dim that is not the model's width (the tables' width), where
      it has one: a TPU lays a weight gradient out with the width minor, and its compiler makes
      an all-reduce + slice a reduce-scatter only when the slice is on a major dim.
    - Else the first dim the fsdp size divides (param_spec).
    - A block weight kept stacked over the layers (model/gpt.py: STACKED) as one layer's weight,
      its layer dim whole."""
    tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    width = tables[0].embedding_dim if tables else None
    root = {id(m.weight) for m in tables}
    head = getattr(model, "lm_head", None)
    if isinstance(head, torch.nn.Linear):
        root.add(id(head.weight))
    specs = {}
    for name, p in model.named_parameters():
        stacked = name.startswith(STACKED + ".")
        shape = tuple(p.shape[1:] if stacked else p.shape)
        first = None
        if id(p) in root:
            first = len(shape) - 1
        elif len(shape) == 2:
            first = next((d for d, n in enumerate(shape) if n != width and n % shard == 0), None)
        spec = param_spec(shape, shard, first)
        specs[name] = (None, *spec) if stacked else spec
    return specs


def batch_spec(ndim: int) -> tuple:
    return (BATCH_AXES,) + (None,) * (ndim - 1)


def sharding_of(t: torch.Tensor) -> str:
    """The runtime's sharding string of an XLA tensor ('' when unannotated)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def local_shard_shapes(t: torch.Tensor) -> list[tuple[int, ...]]:
    """The shape of the piece of `t` each addressable device holds (the device work must be
    done)."""
    import torch_xla

    return [tuple(data.shape) for data, _device in torch_xla._XLAC._get_local_shards([t])[0]]


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """A full CPU copy of an XLA tensor. A sharded one is put together on the host from the shards
    (every shard is on this host: fsdp runs on one host): torch_xla 2.9's .cpu() of sharded data
    compiles a replicating program on every call (one per checkpointed tensor, each save)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    if not sharding_of(t):
        return t.detach().cpu()
    torch_xla._XLAC._xla_sync_multi([t], devices=[], wait=True)  # only t's pending work, if any
    xm.wait_device_ops()
    full = torch.empty(t.shape, dtype=t.dtype)
    shards = torch_xla._XLAC._get_local_shards([t])[0]
    places = torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]
    for (data, _device), (_replica, index) in zip(shards, places, strict=False):
        if index is Ellipsis:  # replicated: any shard is the whole tensor
            return data.clone()
        # the last shard of an uneven split is padded: keep the part its index covers
        full[tuple(index)] = data[tuple(slice(0, i.stop - i.start) for i in index)]
    return full


def _mark(t: torch.Tensor, mesh, spec: tuple, expected: str | None = None) -> str:
    """Annotate `t` with `spec` (clearing a different annotation first); assert the result."""
    import torch_xla.distributed.spmd as xs

    if expected is not None and sharding_of(t) == expected:
        return expected
    if sharding_of(t):
        xs.clear_sharding(t)
    xs.mark_sharding(t, mesh, spec)
    got = sharding_of(t)
    if expected is not None and got != expected:
        raise RuntimeError(
            f"XLA sharding of a tensor of shape {tuple(t.shape)} is {got!r} after marking, "
            f"planned {expected!r}"
        )
    return got


def shard_model(model: torch.nn.Module, mesh, device: torch.device) -> dict[str, tuple]:
    """Send `model`'s parameters (on the CPU) to `device` sharded on the fsdp axis, constrain every
    Linear/Embedding output to the batch sharding, and register the plan for the optimizer hooks.
    Returns {parameter name: partition spec}. Buffers are left for the caller's model.to(device)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    shard = mesh.mesh_shape[AXES.index("fsdp")]
    planned = model_specs(model, shard)
    specs = {id(p): planned[name] for name, p in model.named_parameters()}
    plan, sent = {}, {}
    for module_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in sent:  # a tied weight is sent once and shared again
                spec = specs[id(p)]
                if p.dim() >= 2:
                    data = xm.send_cpu_data_to_device(
                        [p.detach()], device, xs.ShardingSpec(mesh, spec)
                    )[0]
                else:  # torch_xla 2.9's ShardingSpec fails on 1-D tensors: sent whole, then marked
                    data = p.detach().to(device)
                    xs.mark_sharding(data, mesh, spec)
                sent[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
                plan[f"{module_name}.{name}" if module_name else name] = spec
                _PLANNED[sent[id(p)]] = (mesh, spec, sharding_of(sent[id(p)]))
            module._parameters[name] = sent[id(p)]
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.register_forward_hook(_constrain_output(mesh))
    model.register_load_state_dict_post_hook(lambda module, _keys: check_model(module))
    _install_optimizer_hooks()
    return plan


def _constrain_output(mesh):
    import torch_xla.distributed.spmd as xs

    def hook(_module, _args, out):
        if not (tracing_per_device() or _FAKE.get()):
            xs.mark_sharding(out, mesh, batch_spec(out.dim()))

    return hook


def check_model(model: torch.nn.Module) -> None:
    """Every planned parameter of `model` carries its planned sharding (re-marked if a load lost
    it)."""
    for p in model.parameters():
        if p in _PLANNED:
            mesh, spec, expected = _PLANNED[p]
            _mark(p, mesh, spec, expected)


@torch.no_grad()
def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Mark every state tensor shaped like its (planned) parameter with the parameter's sharding
    where it differs; returns how many were marked. Scalars (AdamW's step) stay replicated."""
    marked = 0
    for p, state in optimizer.state.items():
        if p not in _PLANNED:
            continue
        mesh, spec, expected = _PLANNED[p]
        for value in state.values():
            if not isinstance(value, torch.Tensor) or value.shape != p.shape or value in _CHECKED:
                continue
            if sharding_of(value) != expected:
                _mark(value, mesh, spec, expected)
                marked += 1
            _CHECKED[value] = True
    return marked


def _install_optimizer_hooks() -> None:
    """The global step hooks (once per process): before a step (loaded state) and after it (state
    the step created). Optimizers over parameters this module did not plan are left alone."""
    if _HOOKS:
        return
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    # a pre-hook's return value would replace the step's arguments
    def hook(optimizer, _args, _kwargs) -> None:
        shard_optimizer_state(optimizer)

    _HOOKS.append(register_optimizer_step_pre_hook(hook))
    _HOOKS.append(register_optimizer_step_post_hook(hook))
