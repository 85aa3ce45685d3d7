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
one loop body instead of accum copies of it. The optimizer step after it is traced as before.

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class _Traced:
    computation: object  # the While computation (torch_xla's xla_builder)
    sources: list  # per graph input: ("batch", i) | ("param", i) | ("fixed", tensor)
    n_grads: int


@dataclass
class DeviceAccumulation:
    """forward + backward over `accum` stacked micro-batches in one While, traced on the first
    call.

    loss_fn(x, y) -> the mean loss of one micro-batch; the gradients summed into the parameters'
    .grad are those of sum_i loss_i / accum (the step's mean), as the Python loop's."""

    model: torch.nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    accum: int
    _traced: _Traced | None = field(default=None, repr=False)

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

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
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        inputs = [torch.zeros((), dtype=torch.int32, device=x.device), zero]
        inputs += [_zeros_like_sharded(p) for p in params]
        batch = (x, y)
        for kind, ref in t.sources:
            inputs.append(
                batch[ref] if kind == "batch" else params[ref] if kind == "param" else ref
            )
        _, loss, *outputs = torch_xla._XLAC._xla_user_computation(
            "xla::codex_accumulation", inputs, t.computation
        )
        for p, g in zip(params, outputs[: t.n_grads], strict=False):
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
        # data-less placeholders crash torch_xla 2.9 under train.remat=block). The parameters must
        # be device data, not pending IR, so that the lowering sees them as inputs (a no-op
        # normally: the loop synchronises before its first step).
        x0, y0 = (torch.zeros((t.size(0), t.size(2)), dtype=t.dtype).to(t.device) for t in (x, y))
        body_inputs = [x0, y0, *params]
        torch_xla._XLAC._xla_sync_multi(params, devices=[], wait=True, sync_xla_data=False)
        where = {torch_xla._XLAC._xla_get_tensor_id(t): i for i, t in enumerate(body_inputs)}
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss = self.loss_fn(x0, y0)
            (loss / self.accum).backward()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        finally:
            for p, g in zip(params, saved, strict=True):
                p.grad = g
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
        return _Traced(_build_while(body, x, y, params, sources, self.accum), sources, len(params))


def stack_micro_batches(loader, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's `accum` (x, y) micro-batches from the loader as [rows, accum, T] each (CPU)."""
    batches = [next(loader) for _ in range(accum)]
    x, y = (torch.stack([b[k] for b in batches], dim=1) for k in range(2))
    return x, y


def _zeros_like_sharded(p: torch.Tensor) -> torch.Tensor:
    """A zero gradient with its parameter's sharding (SPMD fsdp: the sum stays sharded)."""
    import torch_xla

    g = torch.zeros_like(p)
    sharding = torch_xla._XLAC._get_xla_op_sharding(p)
    if sharding:
        torch_xla._XLAC._xla_mark_sharding(g, sharding)
    return g


def _build_while(body, x, y, params, sources, accum: int):
    """While(i < accum): loss += body(x[:, i], y[:, i], ...)[0]; grads += body(...)[1:]."""
    import torch_xla.core.xla_builder as xb

    builder = xb.create_builder("codex_accumulation")
    shapes = [torch.zeros((), dtype=torch.int32), torch.zeros((), dtype=torch.float32), *params]
    shapes += [
        (x, y)[ref] if kind == "batch" else params[ref] if kind == "param" else ref
        for kind, ref in sources
    ]
    ops = [xb.mkparam(builder, i, xb.tensor_shape(t)) for i, t in enumerate(shapes)]
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

    return xb.Op.mkwhile(ops, cond, step).build("codex_accumulation")


def _micro_batch(stacked, i):
    """stacked[:, i] of a [rows, accum, T] operand, as a [rows, T] operand."""
    rows, _, seq = stacked.shape().sizes
    zero = i.zeros_like()
    return stacked.dynamic_slice([zero, i, zero], [rows, 1, seq]).reshape([rows, seq])
