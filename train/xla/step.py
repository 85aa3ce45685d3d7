"""The XLA step's micro-batches as one XLA While, traced once per run (train.xla_step=cached).

PyTorch/XLA re-runs the Python of every step to build its graph; a Python micro-batch loop hands
XLA `accum` unrolled copies of forward + backward. Here the first step traces one micro-batch,
lowers it to an HLO computation and wraps it in a While over the stacked micro-batches
([rows, accum, T]) that sums the loss and the gradients; every later step puts that one
computation on the lazy graph. Under SPMD replicate the While runs per device and the gradients
are reduced once after it; under fsdp the blocks run as one scanned layer
(train/xla/layer_scan.py). The why and what the HLO shows: docs/tpu.md, "The step's host cost"
and "Where the step's collectives run".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.weak import WeakIdKeyDictionary

from codex.train.xla.layer_scan import ScannedBlocks
from codex.train.xla.reduce_scatter import head_forward
from codex.train.xla.sharding import (
    AXES,
    annotate,
    batch_spec,
    manual_sharding,
    per_device_trace,
    planned_spec,
    sharding_of,
)


@dataclass
class _Traced:
    computation: object  # the While computation (torch_xla's xla_builder)
    sources: list  # per graph input: ("batch", i) | ("param", i) | ("fixed", tensor)
    gather: list  # per parameter: the dtype it is gathered in before the While, or None


@dataclass
class DeviceAccumulation:
    """forward + backward over `accum` stacked micro-batches in one While, traced on the first
    call.

    loss_fn(x, y) -> the mean loss of one micro-batch; the gradients summed into the parameters'
    .grad are those of sum_i loss_i / accum (the step's mean), as the Python loop's.

    mesh: the SPMD mesh of several devices. With an fsdp axis over several devices and a model
    whose blocks can be scanned (a GPT: blocks_runner), ZeRO-3: the While written for the global
    batch, the blocks one scanned layer gathered a layer at a time (in gather_dtype when given,
    train/xla/layer_scan.py) and the gradients reduced into sharded accumulators. Else the While
    runs per device on its rows, the weights whole (another model's sharded weight gathered once
    before it, ZeRO-2) and the gradients reduced once after it. None (one device, or one process
    per chip): the While is the program as written."""

    model: torch.nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    accum: int
    mesh: Any = None
    gather_dtype: torch.dtype | None = None  # fsdp: gather the sharded weights in it (bf16)
    _traced: _Traced | None = field(default=None, repr=False)

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def scanned(self) -> bool:
        """fsdp (a mesh with an fsdp axis over several devices) on a model whose blocks can run
        as one scanned layer: ZeRO-3, the While written for the global batch."""
        if self.mesh is None or not hasattr(self.model, "blocks_runner"):
            return False
        return self.mesh.mesh_shape[AXES.index("fsdp")] > 1

    @property
    def per_device(self) -> bool:
        return self.mesh is not None and self.mesh.size() > 1 and not self.scanned

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y: [rows, accum, T] on the device. Adds the step's gradient to every .grad and
        returns the sum of the micro-batches' mean losses (a lazy device scalar)."""
        import torch_xla

        if x.size(1) != self.accum or y.shape != x.shape:
            raise ValueError(
                f"expected stacked batches [rows, {self.accum}, T], "
                f"got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        params = self.params()
        if self._traced is None:
            self._traced = self._trace(x, y, params)
        t = self._traced
        batch = (x, y)
        inputs = [
            batch[ref] if kind == "batch" else params[ref] if kind == "param" else ref
            for kind, ref in t.sources
        ]
        if self.per_device:
            inputs = [
                _to_local(v, self.mesh, kind == "batch", t.gather[ref] if kind == "param" else None)
                for v, (kind, ref) in zip(inputs, t.sources, strict=True)
            ]
        _, loss, *outputs = torch_xla._XLAC._xla_user_computation(
            "xla::codex_accumulation", inputs, t.computation
        )
        grads = outputs[: len(params)]
        if self.per_device:
            loss = _mean_over_devices(loss, self.mesh)
            grads = [
                _mean_over_devices(g, self.mesh, like=p) for g, p in zip(grads, params, strict=True)
            ]
        elif self.scanned:
            # the accumulators come out sharded: say so, or the update that reads them (traced
            # on stand-ins sharded like them) would be traced replicated and gather them whole
            for g, p in zip(grads, params, strict=True):
                sharding = torch_xla._XLAC._get_xla_op_sharding(p)
                if sharding:
                    torch_xla._XLAC._xla_mark_sharding(g, sharding)
            _read_through(params, t.sources, outputs[len(params) :])
        for p, g in zip(params, grads, strict=True):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        return loss

    def _trace(self, x: torch.Tensor, y: torch.Tensor, params: list[torch.nn.Parameter]) -> _Traced:
        """Trace micro-batch 0 on the real tensors and build the While around its computation."""
        import torch_xla
        import torch_xla.core.xla_builder as xb

        # Micro-batch stand-ins copied from the host (slicing x[:, 0] would compile a program;
        # data-less placeholders crash torch_xla 2.9 under train.remat=block), of one device's
        # rows when the While runs per device. The parameters must be device data, not pending
        # IR, so that the lowering sees them as inputs (a no-op normally: the loop synchronises
        # before its first step).
        rows = x.size(0) // (self.mesh.size() if self.per_device else 1)
        x0, y0 = (torch.zeros((rows, t.size(2)), dtype=t.dtype).to(t.device) for t in (x, y))
        names, gather, stand_ins, upcast = self._stand_ins(params)
        body_inputs = [x0, y0, *stand_ins]
        torch_xla._XLAC._xla_sync_multi(params, devices=[], wait=True, sync_xla_data=False)
        where = {torch_xla._XLAC._xla_get_tensor_id(t): i for i, t in enumerate(body_inputs)}
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            with (
                per_device_trace() if self.per_device else contextlib.nullcontext(),
                _special_scalars(self.per_device or self.scanned),
                _blocks_scanned(self.model, self.mesh, self.gather_dtype)
                if self.scanned
                else contextlib.nullcontext(),
                _reparametrize_module(self.model, upcast, tie_weights=True),
            ):
                loss = self.loss_fn(x0, y0)
                (loss / self.accum).backward()
            leaves = [upcast.get(n, p) for n, p in zip(names, params, strict=True)]
            grads = [
                w.grad if w.grad is not None else torch.zeros_like(p)
                for w, p in zip(leaves, params, strict=True)
            ]
        finally:
            for p, g in zip(params, saved, strict=True):
                p.grad = g
        if self.scanned:  # reduced to its weight's sharding in the body: a sharded accumulator
            for p, g in zip(params, grads, strict=True):
                spec = planned_spec(p)
                if spec is not None:
                    annotate(g, self.mesh, spec)
        outputs = [loss.detach(), *grads]
        ids, values = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs, body_inputs)
        if torch_xla._XLAC._get_seed_info_id() in ids:
            raise RuntimeError(
                "train.xla_step=cached needs a deterministic forward "
                "(the model drew random numbers); "
                "use train.xla_step=traced"
            )
        body = xb.computation_from_module_proto(
            "codex_micro_batch", torch_xla._XLAC._get_xla_tensors_hlo_proto(outputs)
        )
        sources = []
        for tid, value in zip(ids, values, strict=False):
            i = where.get(tid)
            sources.append(
                ("fixed", value) if i is None else ("batch", i) if i < 2 else ("param", i - 2)
            )
        loop = _build_while(body, (x, y), stand_ins, sources, self.accum, x.size(0) // rows)
        return _Traced(loop, sources, gather)

    def _stand_ins(self, params: list) -> tuple[list[str], list, list, dict]:
        """(the parameters' names, gather dtype per parameter, the body's input per parameter,
        {name: upcast copy} of those gathered in another dtype). A
        weight gathered in bf16 enters the body as a bf16 stand-in, upcast inside it: the model
        computes with that upcast copy, and its gradient (fp32) is the weight's."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        gather = [self._gather_dtype(p) for p in params]
        stand_ins = [
            p if d is None else torch.zeros(p.shape, dtype=d).to(p.device)
            for p, d in zip(params, gather, strict=True)
        ]
        upcast = {
            name: s.float().requires_grad_()
            for name, s, d in zip(names, stand_ins, gather, strict=True)
            if d is not None
        }
        return names, gather, stand_ins, upcast

    def _gather_dtype(self, p: torch.Tensor) -> torch.dtype | None:
        """The dtype a sharded weight is gathered in before the per-device While (the compute
        dtype, bf16), or None: replicated, or gathered as it is."""
        if not (self.per_device and self.gather_dtype and p.is_floating_point()):
            return None
        if not _is_sharded(p) or p.dtype == self.gather_dtype:
            return None
        return self.gather_dtype


# parameter -> its value as the last step's While passed it through (unchanged), for the update
_CARRIED = WeakIdKeyDictionary()


def _read_through(params: list, sources: list, carried: list) -> None:
    """Remember each parameter the While carried as the While's output (take_carried): the
    update reads that, the loop's own buffer, so XLA need not copy a donated parameter into the
    loop to keep its value for the update (a copy of every stacked block weight, each step)."""
    import torch_xla

    for (kind, ref), out in zip(sources, carried, strict=True):
        if kind == "param":
            p = params[ref]
            sharding = torch_xla._XLAC._get_xla_op_sharding(p)
            if sharding:
                torch_xla._XLAC._xla_mark_sharding(out, sharding)
            _CARRIED[p] = out


def take_carried(p: torch.Tensor) -> torch.Tensor:
    """`p`'s value as this step's While passed it through, once, else `p` itself."""
    return _CARRIED.pop(p, p)


def stack_micro_batches(loader, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's `accum` (x, y) micro-batches from the loader as [rows, accum, T] each (CPU)."""
    batches = [next(loader) for _ in range(accum)]
    x, y = (torch.stack([b[k] for b in batches], dim=1) for k in range(2))
    return x, y


def _build_while(body, xy, params, sources, accum: int, devices: int):
    """While(i < accum): loss += body(x[:, i], y[:, i], ...)[0]; grads += body(...)[1:], from
    zero. devices: how many devices split the stacked batch's rows (> 1: the While runs per
    device)."""
    import torch_xla.core.xla_builder as xb

    builder = xb.create_builder("codex_accumulation")
    batch = [torch.empty((t.size(0) // devices, *t.shape[1:]), dtype=t.dtype) for t in xy]
    shapes = [
        batch[ref] if kind == "batch" else params[ref] if kind == "param" else ref
        for kind, ref in sources
    ]
    inputs = [xb.mkparam(builder, i, xb.tensor_shape(t)) for i, t in enumerate(shapes)]
    zeros = [xb.Op.scalar(builder, 0, dtype=xb.Type.F32).broadcast(list(p.shape)) for p in params]
    start = [
        xb.Op.scalar(builder, 0, dtype=xb.Type.S32),
        xb.Op.scalar(builder, 0, dtype=xb.Type.F32),
    ]
    n_grads = len(params)

    def cond(i, *rest):
        return i < xb.Op.scalar(i.builder(), accum, dtype=xb.Type.S32)

    def step(i, loss, *rest):
        grads, graph_inputs = list(rest[:n_grads]), list(rest[n_grads:])
        call_inputs = [
            _micro_batch(op, i) if kind == "batch" else op
            for op, (kind, _) in zip(graph_inputs, sources, strict=True)
        ]
        result = xb.Op.call(body, call_inputs)
        loss = loss + result.get_tuple_element(0)
        grads = [g + result.get_tuple_element(1 + k) for k, g in enumerate(grads)]
        one = xb.Op.scalar(i.builder(), 1, dtype=xb.Type.S32)
        return (i + one, loss, *grads, *graph_inputs)

    return xb.Op.mkwhile([*start, *zeros, *inputs], cond, step).build("codex_accumulation")


def _micro_batch(stacked, i):
    """stacked[:, i] of a [rows, accum, T] operand, as a [rows, T] operand."""
    rows, _, seq = stacked.shape().sizes
    zero = i.zeros_like()
    return stacked.dynamic_slice([zero, i, zero], [rows, 1, seq]).reshape([rows, seq])


@contextlib.contextmanager
def _special_scalars(on: bool):
    """Trace with 0 and 1 as constants (torch_xla's special scalars) when `on`. Why: under
    XLA_NO_SPECIAL_SCALARS=1 (set for the optimizer step's changing scalars) a 0 or 1 that the
    forward creates (SDPA's causal mask fill) is device data, which SPMD annotates replicated
    inside the body, and a replicated annotation inside the per-device (manual) While crashes the
    partitioner. The body is traced once, so its constants never change."""
    import torch_xla

    before = torch_xla._XLAC._get_xla_handle_special_scalars()
    torch_xla._XLAC._set_xla_handle_special_scalars(before or on)
    try:
        yield
    finally:
        torch_xla._XLAC._set_xla_handle_special_scalars(before)


def _is_sharded(t: torch.Tensor) -> bool:
    return sharding_of(t) not in ("", "{replicated}")


def _to_local(
    t: torch.Tensor, mesh, batched: bool, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The piece of `t` each device holds, under manual sharding: its rows of a batch, or the
    whole tensor. A sharded (fsdp) parameter is all-gathered into a new value first (cast to
    `dtype` before the gather when given), once per step, before the While; its own sharding
    stays. What xs.enable_manual_sharding does, through torch_xla's C++ calls: its Python wrapper
    tries to import jax and torchax on every call (about 1 ms each, every parameter, every step)."""
    import torch_xla

    spec = batch_spec(t.dim()) if batched else (None,) * t.dim()
    sharding = mesh.get_op_sharding(spec)  # cached by the mesh
    if batched or not _is_sharded(t):
        torch_xla._XLAC._xla_mark_sharding(t, sharding)
        return torch_xla._XLAC._spmd_full_to_shard_shape(t)
    whole = t.detach().to(dtype) if dtype is not None else t.detach().clone()
    # replicated: the partitioner's all-gather
    torch_xla._XLAC._xla_annotate_custom_sharding(whole, sharding)
    return torch_xla._XLAC._spmd_full_to_shard_shape(whole)


def _mean_over_devices(t: torch.Tensor, mesh, like: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over the devices of each device's own (manual) `t`: the devices' values stacked
    on a dim 0 sharded over the mesh, summed (the partitioner's one all-reduce), / devices. `like`:
    give the result that tensor's sharding (an fsdp parameter's gradient stays sharded: the CPU
    pipeline emits all-reduce + dynamic-slice, a TPU one may make it a reduce-scatter). What
    xs.disable_manual_sharding does, through the C++ calls (see _to_local)."""
    import torch_xla

    n = mesh.size()
    stacked = t.unsqueeze(0)
    torch_xla._XLAC._mark_manual_sharding(stacked, manual_sharding())
    full = torch_xla._XLAC._spmd_shard_to_full_shape(
        stacked, mesh.get_op_sharding(batch_spec(stacked.dim())), (n, *t.shape), stacked.dtype
    )
    mean = full.sum(0) / n
    sharding = torch_xla._XLAC._get_xla_op_sharding(like) if like is not None else None
    if sharding:
        torch_xla._XLAC._xla_mark_sharding(mean, sharding)
    return mean


@contextlib.contextmanager
def _blocks_scanned(model, mesh, dtype: torch.dtype | None):
    """While the body is traced: model's blocks run as one scanned layer (ScannedBlocks), their
    weights gathered in `dtype` (autocast's) when given, and a sharded output head's weight
    gradient reduce-scattered by hand (train/xla/reduce_scatter.py)."""
    before = model.blocks_runner  # the backend's validation runner (train=False), if any
    model.blocks_runner = ScannedBlocks(mesh, dtype)
    head = getattr(model, "lm_head", None)
    spec = planned_spec(head.weight) if isinstance(head, torch.nn.Linear) else None
    if isinstance(head, torch.nn.Linear) and spec is not None and "fsdp" in spec:
        head.forward = functools.partial(head_forward, head, mesh, spec)  # type: ignore[method-assign]
    try:
        yield
    finally:
        model.blocks_runner = before
        if head is not None:
            vars(head).pop("forward", None)
