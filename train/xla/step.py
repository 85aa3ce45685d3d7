"""The XLA step's micro-batches as one XLA while loop, traced once per run
(train.xla_step=cached).

Why: PyTorch/XLA builds its graph by running the Python code every step (lazy tracing). The
plain loop (train.xla_step=traced) re-traces forward + backward once per micro-batch and hands
XLA an unrolled graph of `accum` copies: host time per optimizer step grows with accum x depth
(124m at accum 8: ~1.5 s of tracing on a CPU core against ~34 ms of v6e work per micro-batch),
and so does the compile time. Here:

    first step   trace one micro-batch's forward + backward on the real tensors, lower it to an
                 HLO computation, wrap it in a While over the accum micro-batches that sums the
                 loss and the gradients, and keep that computation and its input mapping
    every step   one user-computation node on the lazy graph: (stacked micro-batches, parameters,
                 zero gradients) -> (loss sum, gradient sums). No Python runs the model again.

So the host cost of forward + backward no longer depends on accum or on depth, and XLA compiles
one loop body instead of accum copies of it. The optimizer step after it is cached the same way
(train/xla/update.py).

The body is assumed pure: the model reads only its parameters, its buffers and the batch (no
dropout or other randomness, no state updated in the forward). Tensors the body reads that are
neither the batch nor a parameter (the RoPE tables, constants) are captured at the first trace
and reused; that is right only because they never change during training. It is the same
construction as torch_xla.experimental.gradient_accumulation (an XLA While over a traced body),
which re-traces and re-lowers the body and waits for the device on every call; caching the
computation is what removes the per-step host cost (measured in bench/bench_xla.py).

Batches: the loader's `accum` micro-batches are stacked on dim 1, [rows, accum, T], so dim 0
stays the batch dim the mesh shards (and the per-host minibatch transfer works unchanged); the
loop slices [:, i] inside the While.

Where the gradient is reduced (SPMD, a mesh of several devices). Written for the global batch,
the SPMD partitioner puts each gradient's all-reduce where the gradient is produced: inside the
While, once per micro-batch (a TPU pipeline may hoist it, the CPU one does not; codex does not
count on either). So under replicate the While runs per device, as MaxText's scan does: the
batch and the parameters enter it through manual sharding (`enable_manual_sharding`: each device
sees its own rows and the whole, replicated, parameters), the body is traced at the local shapes
and holds no collective, the carry holds each device's unreduced fp32 gradient sum, and after
the While one sum over the devices (`disable_manual_sharding` to [devices, ...], then sum(0))
is the one all-reduce per gradient of the step. tests/train/xla/test_xla_program.py reads it in the
compiled HLO.

fsdp is ZeRO-3, MaxText's: the While is written for the global batch and the partitioner
places the collectives, steered by sharding annotations. Inside the micro-batch body the blocks
run as one scanned layer (`scanned_blocks`: torch_xla's scan construction, a While over the
layers): each block weight is stacked over the layers ([n_layer, ...], sharded as the weight),
the loop slices one layer's weights per iteration and all-gathers them there (in the compute
dtype under bf16, cast on the shard), once in the forward loop and once again in the backward
one; the slice is loop-variant, so no loop-invariant pass can hoist the gathers out. Each
layer's gradient is reduced inside the backward loop to the weight's sharding (the CPU pipeline
emits all-reduce + dynamic-slice; a TPU one, a reduce-scatter) and the micro-batch While
accumulates it in fp32 accumulators sharded as the weights: 4 P / F bytes per chip, never a
whole gradient. The root (embedding, head, final norm) is gathered whole, once per step (the
partitioner hoists that gather out of the micro-batch While). Per chip: the sharded weights,
gradients and optimizer state, the stacked copy of the block weights (sharded, made once a step
before the micro-batch While) and the backward loop's stacked sharded gradient of the
micro-batch, a gathered layer or two (the one computing; XLA's scheduler may prefetch the next),
the gathered root and the activations (train/plan/memory.py's plan). The stacking is
inside the traced step: the model, its state_dict and the checkpoints stay per layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from codex.train.xla.sharding import (
    AXES,
    batch_spec,
    fake_trace,
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
    batch, the blocks one scanned layer gathered a layer at a time (in gather_dtype when given)
    and the gradients reduced into sharded accumulators (module doc). Else the While runs per
    device on its rows, the weights whole (another model's sharded weight gathered once before
    it, ZeRO-2) and the gradients reduced once after it. None (one device, or one process per
    chip): the While is the program as written."""

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
        as one scanned layer: ZeRO-3, the While written for the global batch (module doc)."""
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
                    _annotate(g, self.mesh, spec)
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


@functools.cache
def _manual_sharding():
    """torch_xla's OpSharding of type MANUAL (made on first use: torch_xla is imported late)."""
    import torch_xla
    from torch_xla.distributed.spmd import ShardingType

    return torch_xla._XLAC.OpSharding([], [], [], ShardingType.MANUAL)


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
    torch_xla._XLAC._mark_manual_sharding(stacked, _manual_sharding())
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
    """While the body is traced: model's blocks run as one scanned layer (scanned_blocks), their
    weights gathered in `dtype` (autocast's) when given."""
    model.blocks_runner = functools.partial(scanned_blocks, mesh=mesh, dtype=dtype)
    try:
        yield
    finally:
        model.blocks_runner = None


def scanned_blocks(model, x, cos, sin, idx, mesh, dtype: torch.dtype | None = None):
    """The GPT's blocks as one layer scanned over their stacked weights (a While over the layers,
    torch_xla's scan construction), for fsdp under SPMD: the stack of each weight keeps the
    weight's sharding on a new leading layer dim, and inside the scan the layer's slice is
    annotated with that sharding again, so the partitioner gathers one layer's weights per
    iteration (the slice is loop-variant: no pass can hoist the gather out), cast to `dtype` on
    its shard first when given, and each layer's gradient is annotated whole, then sharded, so it
    is summed over the batch and cut to this device's part inside the backward scan (all-reduce +
    dynamic-slice, which a TPU pipeline makes a reduce-scatter). The backward gathers the layer's
    weights again (ZeRO-3: nothing gathered is kept from the forward).

    7 parameters: GPT.blocks_runner's five, then the mesh and the gather dtype bound to them.

    A layer without a value embedding adds zeros (the same sum). torch_xla's own Scan is not used:
    its SPMD backward pins shardings through JAX (shard_alike), which codex does not install."""
    from torch_xla.experimental.scan import value_and_grad_partitioned

    blocks = list(model.blocks)
    per_layer = [dict(b.named_parameters()) for b in blocks]
    specs = {n: planned_spec(w) for n, w in per_layer[0].items()}
    stacked = {}
    for name, spec in specs.items():
        stacked[name] = torch.stack([layer[name] for layer in per_layer])
        if spec is not None:
            _annotate(stacked[name], mesh, (None, *spec))
    n = len(blocks)
    xs: dict = {"params": stacked, "rope": (cos.expand(n, *cos.shape), sin.expand(n, *sin.shape))}
    ves = [model.value_embedding(i, idx) for i in range(n)]
    like = next((v for v in ves if v is not None), None)
    if like is not None:
        xs["ve"] = torch.stack([torch.zeros_like(like) if v is None else v for v in ves])
    template = blocks[0]
    # train.remat=block replaced each block's forward by a checkpointed one; under the scan the
    # partitioner of the layer's forward and backward graphs rematerialises instead
    remat = "forward" in vars(template)

    def one_layer(h, layer):
        with _reparametrize_module(template, layer["params"]):
            out = type(template).forward(template, h, *layer["rope"], layer.get("ve"))
        return out, None

    # The min-cut partitioner (torch.compile's): the backward recomputes what is cheap from the
    # layer's inputs (the weights' transposes, which saved would be whole gathered weights of
    # every layer); remat: a zero activation budget, it recomputes all it can
    budget = 0.0 if remat else 1.0
    with fake_trace(), torch._functorch.config.patch(activation_memory_budget=budget):
        forward, alias_input, backward = value_and_grad_partitioned(
            one_layer, x, xs, partition_fn=_partition_saving_inputs
        )
    activation = batch_spec(x.dim())
    # which of the backward's saved activations are the layer's weights (torch_xla's scan saves
    # its inputs by reference): {index: weight name}, learnt when the forward runs
    saved_weights: dict[int, str] = {}

    def gathered(t: torch.Tensor, spec) -> torch.Tensor:
        """A weight slice: sharded as its parameter, cast to the compute dtype on the shard, then
        whole (the layer's all-gather here). Under autocast the layer casts every weight to that
        dtype before any use, so the cast moves no result, and the gather moves half the bytes."""
        if spec is None:
            return t
        _annotate(t, mesh, spec)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        _annotate(t, mesh, (None,) * t.dim())
        return t

    def forward_pinned(h, layer):
        params = {name: gathered(t, specs[name]) for name, t in layer["params"].items()}
        layer = {**layer, "params": params}
        if "ve" in layer:
            _annotate(layer["ve"], mesh, activation)
        _annotate(h, mesh, activation)
        h, y = forward(h, layer)
        _annotate(h, mesh, activation)
        return h, y

    def backward_pinned(grad_h, saved):
        grad_y, activations = saved
        activations = list(activations)
        for i, name in saved_weights.items():
            activations[i] = gathered(activations[i], specs[name])
        _annotate(grad_h, mesh, activation)
        grad_h, grad_layer = backward(grad_h, (grad_y, activations))
        _annotate(grad_h, mesh, activation)
        for name, g in grad_layer["params"].items():
            if specs[name] is not None:  # the whole gradient summed over the batch, then sharded
                _annotate(g, mesh, (None,) * g.dim())
                _annotate(g, mesh, specs[name])
        if grad_layer.get("ve") is not None:
            _annotate(grad_layer["ve"], mesh, activation)
        return grad_h, grad_layer

    def remember(activations):
        leaves = {id(t): name for name, t in stacked.items()}
        saved_weights.update(
            {i: leaves[id(a)] for i, a in enumerate(activations) if id(a) in leaves}
        )

    out, _ = _LayerScan.apply(forward_pinned, alias_input, backward_pinned, remember, x, xs)
    return out


def _partition_saving_inputs(joint, inputs, **kwargs):
    """min_cut_rematerialization_partition, then every saved activation that is only a view or
    a cast of a layer input (a weight's transpose transposed back, t(t(W)); its bf16 copy under
    autocast) saved as that input instead, the views and casts redone in the backward. Why:
    torch_xla's scan stacks every saved activation over the layers, and tells a saved input
    (kept by reference: the stacked sharded weight) by identity only; a view of a weight would be
    stacked as the whole gathered weight of every layer."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    fwd, bwd = min_cut_rematerialization_partition(joint, inputs, **kwargs)
    n_out = kwargs["num_fwd_outputs"]
    (output,) = [n for n in fwd.graph.nodes if n.op == "output"]
    outs = list(output.args[0])
    places = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    saved = dict(zip(outs[n_out:], places, strict=False))  # fwd node -> its bwd placeholder
    by_input = {n: place for n, place in saved.items() if n.op == "placeholder"}
    changed = False
    for node, place in list(saved.items()):
        chain, src = [], node
        while src.op == "call_function" and src.target in _views():
            chain.append(src)
            src = src.args[0]
        if not chain or src.op != "placeholder":
            continue
        drop = src in by_input  # the input is saved already: this entry goes
        if drop:
            base = by_input[src]
            outs.remove(node)
        else:  # the input saved in this entry's place
            outs[outs.index(node)] = src
            by_input[src] = base = place
        value, anchor, views = base, places[-1], []
        for view in reversed(chain):
            with bwd.graph.inserting_after(anchor):
                value = anchor = bwd.graph.call_function(
                    view.target, (value, *view.args[1:]), dict(view.kwargs)
                )
            views.append(value)
        place.replace_all_uses_with(value, delete_user_cb=lambda user, v=views: user not in v)
        if drop:
            bwd.graph.erase_node(place)
        changed = True
    if changed:
        # torch_xla's scan pairs the saved inputs with its inputs in order: save them in order
        order = {n: i for i, n in enumerate(n for n in fwd.graph.nodes if n.op == "placeholder")}
        places = [n for n in bwd.graph.nodes if n.op == "placeholder"]
        pairs = list(zip(outs[n_out:], places, strict=False))  # the tangents come last
        slots = [i for i, (n, _) in enumerate(pairs) if n in order]
        ordered = sorted((pairs[i] for i in slots), key=lambda q: order[q[0]])
        for i, pair in zip(slots, ordered, strict=True):
            pairs[i] = pair
        outs[n_out:] = [n for n, _ in pairs]
        anchor = next(iter(bwd.graph.nodes))
        anchor.prepend(pairs[0][1])
        for _, place in pairs:  # the bwd's saved-value placeholders in the same order
            if place is not pairs[0][1]:
                anchor.append(place)
            anchor = place
        output.args = (tuple(outs),)
        fwd.graph.lint()
        bwd.graph.lint()
        fwd.recompile()
        bwd.recompile()
    return fwd, bwd


@functools.cache
def _views() -> frozenset:
    """The aten ops that only view or cast their first argument (what _partition_saving_inputs
    replays in the backward instead of saving their result)."""
    aten = torch.ops.aten
    return frozenset(
        {
            aten.t.default,
            aten.transpose.int,
            aten.permute.default,
            aten.view.default,
            aten._unsafe_view.default,
            aten.reshape.default,
            aten.expand.default,
            aten.detach.default,
            aten.alias.default,
            aten._to_copy.default,  # autocast's cast of a weight to the compute dtype
        }
    )


def _annotate(t: torch.Tensor, mesh, spec: tuple) -> None:
    """A sharding constraint on `t`'s value (a Sharding custom-call in the HLO), in place."""
    import torch_xla

    torch_xla._XLAC._xla_annotate_custom_sharding(t, mesh.get_op_sharding(spec))


def _layer_scan_class():
    """torch_xla's Scan autograd Function without its SPMD backward wrapper (which imports JAX):
    the forward scan keeps its activations, the backward scans the gradients in reverse."""
    from torch_xla.experimental.pytreeify import pytreeify
    from torch_xla.experimental.scan import _scan_impl_pytree

    @pytreeify
    class LayerScan(torch.autograd.Function):
        @staticmethod
        def forward(ctx, forward, alias_input, backward, remember, init, xs):
            """7 parameters: an autograd Function's inputs, passed positionally by apply."""
            with torch.no_grad():
                carry, (ys, partial) = _scan_impl_pytree(forward, init, xs)
            activations = alias_input(partial, xs)
            remember(activations)
            ctx.backward_fn = backward
            flat, ctx.spec = tree_flatten(activations)
            ctx.save_for_backward(*flat)
            return carry, ys

        @staticmethod
        def backward(ctx, grad_carry, grad_ys):
            activations = tree_unflatten(list(ctx.saved_tensors), ctx.spec)
            with torch.no_grad():
                grad_init, grad_xs = _scan_impl_pytree(
                    ctx.backward_fn, grad_carry, (grad_ys, activations), reverse=True
                )
            return None, None, None, None, grad_init, grad_xs

    return LayerScan


class _Lazy:
    """_LayerScan.apply, the class built on first use (torch_xla is imported late)."""

    @functools.cached_property
    def cls(self):
        return _layer_scan_class()

    def apply(self, *args):
        return self.cls.apply(*args)


_LayerScan = _Lazy()
