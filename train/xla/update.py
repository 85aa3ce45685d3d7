"""The optimizer update (gradient clipping + optimizer.step) traced once per run on XLA
(train.xla_step=cached).

Lazy tracing would run the optimizer's Python every step: a few hundred tensor operations per
parameter group, the bulk of a step's host time once forward + backward are cached
(train/xla/step.py). So the first step lowers clip + step to one HLO computation, and every step
puts that one computation on the lazy graph: (parameters, gradients, optimizer state, lr) ->
(parameters, optimizer state, gradient norm). How it is traced, Muon's split stacks, and what the
update may read: docs/tpu.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from codex.train.optim.optimizer import clip_grad_norm
from codex.train.xla.sharding import planned_spec, shard_optimizer_state
from codex.train.xla.step import take_carried


@dataclass
class _Traced:
    computation: object
    # per computation input: ("tensor", index into _tensors()) | ("lr", 0) | ("fixed", tensor)
    sources: list
    signature: tuple  # shapes and dtypes of _tensors() it was traced for


@dataclass
class CachedUpdate:
    """clip_grad_norm(model, max_norm) + optimizer.step() as one cached XLA computation.

    __call__(lr) sets the new parameters and optimizer state, exactly as the two calls would
    with the groups' lr set by set_lr(optimizer, lr), and returns the gradient norm before
    clipping (a lazy device scalar)."""

    model: torch.nn.Module
    optimizer: Any  # torch.optim.Optimizer or train.optim.muon.Optimizers
    max_norm: float
    _traced: _Traced | None = field(default=None, repr=False)
    traces: int = 0  # how many times the update's Python ran (tests read it)

    def __call__(self, lr: float) -> torch.Tensor:
        import torch_xla

        params = [p for p in self.model.parameters() if p.grad is not None]
        tensors = _tensors(params, self.optimizer)
        if self._traced is None or self._traced.signature != _signature(tensors):
            _init_state(self.optimizer)  # before a trace only: not every step's work
            self._traced = self._trace(params)
            tensors = _tensors(params, self.optimizer)  # the state's new tensors (_reown)
        # the weights as the step's While passed them through (fsdp): the loop's own buffers
        tensors[: len(params)] = [take_carried(p) for p in params]
        lr_t = _lr_on_device(lr, params[0].device)
        inputs = [
            tensors[ref] if kind == "tensor" else lr_t if kind == "lr" else ref
            for kind, ref in self._traced.sources
        ]
        norm, *results = torch_xla._XLAC._xla_user_computation(
            "xla::codex_update", inputs, self._traced.computation
        )
        with torch.no_grad():
            for dst, src in zip(_updated(params, self.optimizer), results, strict=True):
                dst.copy_(src)  # in place: XLA reuses the old buffer (donation)
        return norm

    def _trace(self, params: list[torch.nn.Parameter]) -> _Traced:
        """Run clip + step once on stand-ins and lower what it computed. The stand-ins: aliases
        of the parameters' and state's device buffers (new tensors on the same data, so the trace
        leaves the real tensors as they are and copies nothing), zeros for the gradients (the
        real ones are still the pending forward + backward, which the lowering would pull in),
        and the lr as a device scalar (an input, not a constant)."""
        import torch_xla
        import torch_xla.core.xla_builder as xb

        self.traces += 1
        # fsdp: loaded optimizer state comes back replicated; give it its parameter's sharding
        # now (the step's pre-hook would re-mark only the stand-ins, in new buffers)
        for opt in _optimizers(self.optimizer):
            shard_optimizer_state(opt)
        # the stand-ins alias device data: nothing may be pending (nothing is, between steps)
        torch_xla._XLAC._xla_sync_multi(
            _updated(params, self.optimizer), devices=[], wait=True, sync_xla_data=False
        )
        _own_buffers(self.optimizer)
        real = _tensors(params, self.optimizer)
        n = len(params)
        stand_ins = [
            _zeros_like(t) if n <= i < 2 * n else buffer_alias(t) for i, t in enumerate(real)
        ]
        lr_t = _lr_on_device(0.5, params[0].device)
        # Inputs are told apart by their device buffer: a tensor id would not do, an in-place
        # update gives the traced tensor a new one.
        handles = torch_xla._XLAC._get_tensors_handle([*stand_ins, lr_t])
        where = {h: i for i, h in enumerate(handles[:-1])}
        with (
            _swapped(params, self.optimizer, stand_ins),
            _lr_as_tensor(self.optimizer, lr_t),
            _muon_stacks_split(self.optimizer),
        ):
            norm = clip_grad_norm(self.model, self.max_norm)
            self.optimizer.step()
            # read inside: leaving _swapped gives the parameters their real data back
            outputs = [norm, *(p.data for p in params), *state_tensors(self.optimizer)]
        _, values = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs)
        sources = [
            ("lr", 0) if h == handles[-1] else ("tensor", where[h]) if h in where else ("fixed", v)
            for h, v in zip(torch_xla._XLAC._get_tensors_handle(values), values, strict=True)
        ]
        read = {ref for kind, ref in sources if kind == "tensor"}
        missing = [tuple(t.shape) for i, t in enumerate(real) if i not in read]
        if missing or "lr" not in {kind for kind, _ in sources}:
            # an input changed buffer during the trace: its value would be baked in as a constant
            raise RuntimeError(
                f"the cached XLA update lost track of inputs of shapes {missing or ['lr']}; "
                "use train.xla_step=traced"
            )
        computation = xb.computation_from_module_proto(
            "codex_update", torch_xla._XLAC._get_xla_tensors_hlo_proto(outputs)
        )
        _reown(params, self.optimizer)
        return _Traced(computation, sources, _signature(real))


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    return list(getattr(optimizer, "optimizers", {"": optimizer}).values())


def _state_entries(optimizer) -> list[tuple[dict, str, torch.Tensor]]:
    """Every optimizer state tensor as (its state dict, key, tensor), in a fixed order
    (optimizer, group, parameter, key)."""
    out: list[tuple[dict, str, torch.Tensor]] = []
    for opt in _optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p, {})
                out.extend(
                    (state, k, v) for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)
                )
    return out


def state_tensors(optimizer) -> list[torch.Tensor]:
    return [v for _, _, v in _state_entries(optimizer)]


def _tensors(params: list[torch.nn.Parameter], optimizer) -> list[torch.Tensor]:
    """What the update reads: parameters, their gradients, the optimizer state."""
    grads = [p.grad for p in params if p.grad is not None]
    return [*params, *grads, *state_tensors(optimizer)]


def _updated(params: list[torch.nn.Parameter], optimizer) -> list[torch.Tensor]:
    """What the update writes: parameters and optimizer state."""
    return [*params, *state_tensors(optimizer)]


def _signature(tensors: list[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (CPU) as device data in a buffer of its own. Not `t.to(device)`: a 0-dim tensor would
    become a scalar constant, or share one cached buffer with every equal scalar."""
    import torch_xla.core.xla_model as xm

    return xm.send_cpu_data_to_device([t], device)[0]


def _lr_on_device(lr: float, device: torch.device) -> torch.Tensor:
    return _upload(torch.tensor(lr, dtype=torch.float32), device)


def buffer_alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor on `t`'s device buffer (no copy): in-place updates to it leave `t` as it is.
    Dropped before any sync, so XLA never donates the shared buffer."""
    import torch_xla

    (alias,) = torch_xla._XLAC._get_tensors_xla_device_data_node([t])[1]
    return alias


def _reown(params: list[torch.nn.Parameter], optimizer) -> None:
    """After a trace on aliases: the parameters and state on new tensors over their same buffers.
    A buffer records the tensor that last put it on a graph, and XLA donates an input buffer to
    the output that updates that tensor in place; the trace's aliases were the last, so without
    this the first step's program would donate nothing and hold every parameter and state
    tensor twice."""
    for p in params:
        p.data = buffer_alias(p)
    for state, key, t in _state_entries(optimizer):
        state[key] = buffer_alias(t)


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    """Zeros shaped, typed and sharded like `t`, as device data (a transfer, not a program)."""
    import torch_xla

    out = _upload(torch.zeros(t.shape, dtype=t.dtype), t.device)
    sharding = torch_xla._XLAC._get_xla_op_sharding(t)
    if sharding:
        torch_xla._XLAC._xla_mark_sharding(out, sharding)
    return out


def _init_state(optimizer) -> None:
    """Create missing optimizer state as torch would on the first step (zeros, AdamW's step
    count 0), as device data sharded like its parameter, so the first step's trace already has
    the state as inputs: one trace per run, not one for the first step and one for the rest."""
    from codex.train.optim.muon import Muon

    for opt in _optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                if opt.state.get(p):
                    continue
                if isinstance(opt, Muon):
                    opt.state[p] = {"momentum_buffer": _zeros_like(p)}
                elif isinstance(opt, torch.optim.AdamW) and group["capturable"]:
                    if group["amsgrad"]:
                        raise ValueError("the cached XLA update does not trace AMSGrad")
                    scalar = (
                        torch.float64
                        if torch.get_default_dtype() == torch.float64
                        else torch.float32
                    )
                    opt.state[p] = {
                        "step": _upload(torch.zeros((), dtype=scalar), p.device),
                        "exp_avg": _zeros_like(p),
                        "exp_avg_sq": _zeros_like(p),
                    }
                else:
                    raise ValueError(
                        f"the cached XLA update traces Muon and capturable AdamW, not "
                        f"{type(opt).__name__}: use train.xla_step=traced"
                    )


def _own_buffers(optimizer) -> None:
    """Give every optimizer state tensor a device buffer of its own: equal scalars loaded with
    .to(device) (AdamW's step counts after a resume) may share one, and the trace tells its
    inputs apart by buffer."""
    import torch_xla

    seen = set()
    for state, key, t in _state_entries(optimizer):
        (handle,) = torch_xla._XLAC._get_tensors_handle([t])
        if handle in seen:
            state[key] = _upload(t.cpu(), t.device)
        seen.add(handle)


@contextlib.contextmanager
def _swapped(params: list[torch.nn.Parameter], optimizer, stand_ins: list[torch.Tensor]):
    """The parameters' data, their gradients and the optimizer state replaced by `stand_ins`
    (in _tensors' order) for the trace; the real ones back after it."""
    n = len(params)
    data = [p.data for p in params]
    grads = [p.grad for p in params]
    states = _state_entries(optimizer)
    for p, s in zip(params, stand_ins[:n], strict=True):
        p.data = s
    for p, s in zip(params, stand_ins[n : 2 * n], strict=True):
        p.grad = s
    for (state, key, _), s in zip(states, stand_ins[2 * n :], strict=True):
        state[key] = s
    try:
        yield
    finally:
        for p, d, g in zip(params, data, grads, strict=True):
            p.data, p.grad = d, g
        for state, key, value in states:
            state[key] = value


@contextlib.contextmanager
def _muon_stacks_split(optimizer):
    """While the update is traced under SPMD on several devices: each of Muon's stacks (one
    [n, rows, cols] per shape group, train/optim/muon.py) split along dim 0 over every device, so
    each chip iterates on ceil(n / devices) of the group's matrices instead of all n. Where the
    iterated stack goes: replicated weights need every update whole on every chip, so it is
    replicated again (the partitioner inserts the all-gather). Sharded weights (fsdp) need only
    their shards' rows: it is split along its rows instead (an all-to-all) and each update is
    given its weight's sharding (a wide one's rows are that already; a tall one, iterated
    transposed, is resharded by itself), so a chip holds about 1 / devices of every group's
    updates and never a whole stack. One device, or spawn mode (a process per chip, no
    partitioner), leaves the stacks whole."""
    import torch_xla
    import torch_xla.runtime as xr

    from codex.train.optim.muon import Muon

    muons = [opt for opt in _optimizers(optimizer) if isinstance(opt, Muon)]
    devices = xr.global_runtime_device_count() if xr.is_spmd() else 1
    if not muons or devices == 1:
        yield
        return
    import numpy as np
    import torch_xla.distributed.spmd as xs

    # every device along one axis: whatever the model's (replica, fsdp) mesh, all chips share it
    mesh = xs.Mesh(np.arange(devices), (devices,), ("stack",))
    sharded = any(
        any(planned_spec(p) or ())
        for opt in muons
        for group in opt.param_groups
        for p in group["params"]
    )
    held = (None, "stack", None) if sharded else (None, None, None)

    def place(stack: torch.Tensor, split: bool) -> None:
        xs.mark_sharding(stack, mesh, ("stack", None, None) if split else held)

    def place_update(update: torch.Tensor, p: torch.Tensor) -> None:
        if any(planned_spec(p) or ()):
            sharding = torch_xla._XLAC._get_xla_op_sharding(p)
            if sharding is None:  # the trace's stand-in lost its parameter's sharding
                raise RuntimeError(f"Muon's update of a {tuple(p.shape)} weight has no sharding")
            torch_xla._XLAC._xla_annotate_custom_sharding(update, sharding)

    for opt in muons:
        opt.place_stack = place
        opt.place_update = place_update if sharded else None
    try:
        yield
    finally:
        for opt in muons:
            opt.place_stack = None
            opt.place_update = None


@contextlib.contextmanager
def _lr_as_tensor(optimizer, lr_t: torch.Tensor):
    """Every group's lr as the device scalar `lr_t` (times the group's lr_ratio: Muon's) while the
    update is traced, so the learning rate is an input of the computation, not a constant."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        ratio = group.get("lr_ratio")
        group["lr"] = lr_t * ratio if ratio is not None else lr_t
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
