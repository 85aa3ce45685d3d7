"""fsdp's layer loop under XLA SPMD (ZeRO-3): the GPT's blocks as one layer scanned over their
stacked weights (torch_xla's scan construction, a While over the layers), each layer's weights
gathered inside the loop and its gradient reduced there.

The cached step (train/xla/step.py) sets `ScannedBlocks` as GPT.blocks_runner while it traces its
body; the model, its state_dict and the checkpoints stay per layer. torch_xla's own Scan is not
used: its SPMD backward pins shardings through JAX (shard_alike), which codex does not install.
The collectives this places: docs/tpu.md, "Where the step's collectives run".
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from codex.model.gpt import STACKED
from codex.train.xla.reduce_scatter import WeightGradReducer
from codex.train.xla.sharding import annotate, batch_spec, fake_trace, planned_spec


@dataclass(frozen=True)
class ScannedBlocks:
    """GPT.blocks_runner for fsdp under SPMD: the blocks as one layer scanned over their stacked
    weights. The stack of each weight keeps the weight's sharding on a new leading layer dim, and
    inside the scan the layer's slice is annotated with that sharding again, so the partitioner
    gathers one layer's weights per iteration (the slice is loop-variant: no pass can hoist the
    gather out), cast to `dtype` on its shard first when given, and each layer's matrix gradients
    are reduce-scattered to their weights' sharding inside the backward scan, written by hand
    (train/xla/reduce_scatter.py), in the compute dtype, widened on the shard after; any other
    gradient (a norm gain's) is annotated whole, then sharded: the partitioner's all-reduce. The
    backward gathers the layer's weights again (ZeRO-3: nothing gathered is kept from the
    forward). A layer without a value embedding adds zeros (the same sum)."""

    mesh: Any
    dtype: torch.dtype | None = None  # gather the weights in it (autocast's compute dtype)
    # False: installed for the run (validation): a forward with gradients (train.xla_step=traced)
    # runs the blocks one by one; the cached step's body installs its own for the trace
    train: bool = True

    def __call__(
        self, model, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor:
        """GPT.blocks_runner's call: the blocks' output for input `x` (see GPT.blocks). Without
        gradients (validation) the forward loop alone (forward_only)."""
        from torch_xla.experimental.scan import value_and_grad_partitioned

        if not torch.is_grad_enabled():
            return self.forward_only(model, x, cos, sin, idx)
        if not self.train:
            for i, block in enumerate(model.blocks):
                with _reparametrize_module(block, layer_weights(model, i)):
                    x = block(x, cos, sin, model.value_embedding(i, idx))
            return x
        blocks = list(model.blocks)
        specs, stacked, xs = self._layer_inputs(model, x, cos, sin, idx)
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
        # the weights' places among the layer's inputs (the carry, then xs's leaves): their
        # gradients leave the backward graph in the compute dtype, cast after their reduction;
        # a sharded matrix's is reduce-scattered there by hand (train/xla/reduce_scatter.py)
        names = {id(t): name for name, t in stacked.items()}
        flat = tree_flatten((x, xs))[0]
        weights = {i: names[id(t)] for i, t in enumerate(flat) if id(t) in names}
        reducers = {
            i: WeightGradReducer(self.mesh, specs[name])
            for i, name in weights.items()
            if specs[name] is not None and "fsdp" in specs[name]
        }
        by_hand: set[int] = set()
        partition = functools.partial(
            _partition_reducing, narrow=list(weights), reducers=reducers, by_hand=by_hand
        )
        with fake_trace(), torch._functorch.config.patch(activation_memory_budget=budget):
            forward, alias_input, backward = value_and_grad_partitioned(
                one_layer, x, xs, partition_fn=partition
            )
        reduced = {weights[i] for i in by_hand}
        activation = batch_spec(x.dim())
        layer = _PinnedLayer(self, specs, stacked, activation, forward, backward, reduced=reduced)
        out, _ = _LayerScan.apply(layer.forward, alias_input, layer.backward, layer.remember, x, xs)
        return out

    def forward_only(self, model, x, cos, sin, idx) -> torch.Tensor:
        """The blocks' forward as one While over the layers, nothing kept for a backward: each
        layer's weights gathered inside the loop (as the training step's forward loop does), so
        validation under fsdp holds one gathered layer at a time."""
        from torch_xla.experimental.scan import _scan_impl_pytree

        specs, _, xs = self._layer_inputs(model, x, cos, sin, idx)
        template, mesh, activation = model.blocks[0], self.mesh, batch_spec(x.dim())

        def one_layer(h, layer):
            params = {
                name: gathered(t, specs[name], mesh, self.dtype)
                for name, t in layer["params"].items()
            }
            if "ve" in layer:
                annotate(layer["ve"], mesh, activation)
            annotate(h, mesh, activation)
            with _reparametrize_module(template, params):
                out = type(template).forward(template, h, *layer["rope"], layer.get("ve"))
            annotate(out, mesh, activation)
            return out, None

        out, _ = _scan_impl_pytree(one_layer, x, xs)
        return out

    def _layer_inputs(self, model, x, cos, sin, idx) -> tuple[dict, dict, dict]:
        """(weight specs, stacked weights, the scan's xs: the stacks, the RoPE tables and the
        value embeddings, one per layer; a layer without one adds zeros)."""
        specs, stacked = self._stacked_weights(model)
        n = len(model.blocks)
        xs: dict = {
            "params": stacked,
            "rope": (cos.expand(n, *cos.shape), sin.expand(n, *sin.shape)),
        }
        ves = [model.value_embedding(i, idx) for i in range(n)]
        like = next((v for v in ves if v is not None), None)
        if like is not None:
            xs["ve"] = torch.stack([torch.zeros_like(like) if v is None else v for v in ves])
        return specs, stacked, xs

    def _stacked_weights(self, model) -> tuple[dict, dict]:
        """({weight name: one layer's partition spec}, {weight name: [n_layer, ...] stack}): the
        stacks the model keeps (stack_blocks), or each made here from the blocks' weights, sharded
        as its weight, on a new leading layer dim (a stacked copy of the weights every step)."""
        if STACKED in model._modules:
            stacked = dict(model.get_submodule(STACKED).named_parameters())
            layer = {n: planned_spec(w) for n, w in stacked.items()}
            return {n: None if s is None else s[1:] for n, s in layer.items()}, stacked
        per_layer = [dict(b.named_parameters()) for b in model.blocks]
        specs = {n: planned_spec(w) for n, w in per_layer[0].items()}
        stacked = {}
        for name, spec in specs.items():
            stacked[name] = torch.stack([layer[name] for layer in per_layer])
            if spec is not None:
                annotate(stacked[name], self.mesh, (None, *spec))
        return specs, stacked


def stack_blocks(model: torch.nn.Module) -> None:
    """Keep `model`'s block weights stacked (before it is sharded; CPU): each block weight of
    every layer as one [n_layer, ...] Parameter of `model.stacked_blocks` (a copy of block 0's
    modules: the same names), the blocks' own slots emptied. The layer loops read the stacks as
    they are; any other forward (layer_weights) reads a layer's slices. Checkpoints keep the
    per-layer names (train/checkpoint/state.py)."""
    blocks = list(cast(torch.nn.ModuleList, model.blocks))
    holder = copy.deepcopy(blocks[0])
    for module_name, module in holder.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            layers = [b.get_parameter(full).detach() for b in blocks]
            module._parameters[name] = torch.nn.Parameter(
                torch.stack(layers), requires_grad=p.requires_grad
            )
    for block in blocks:
        for module in block.modules():
            for name in module._parameters:
                module._parameters[name] = None
    model.add_module(STACKED, holder)


def layer_weights(model: torch.nn.Module, i: int) -> dict[str, torch.Tensor]:
    """{block weight name: layer i's slice of its stack} ({} when the blocks hold their own)."""
    if STACKED not in model._modules:
        return {}
    return {n: w[i] for n, w in model.get_submodule(STACKED).named_parameters()}


@dataclass
class _PinnedLayer:
    """One scanned layer's partitioned forward and backward with their shardings pinned: the
    activations to the batch sharding, each weight slice gathered in the layer, each weight
    gradient reduced to its weight's sharding."""

    scan: ScannedBlocks
    specs: dict  # weight name -> its parameter's partition spec (None: replicated)
    stacked: dict  # weight name -> its [n_layer, ...] stack
    activation: tuple  # an activation's partition spec: the batch sharding
    partitioned_forward: Callable
    partitioned_backward: Callable
    # which of the backward's saved activations are the layer's weights (torch_xla's scan saves
    # its inputs by reference): {index: weight name}, learnt when the forward runs
    saved_weights: dict[int, str] = field(default_factory=dict)
    # the weights whose gradient the backward graph reduce-scatters itself (_reduce_by_hand)
    reduced: set[str] = field(default_factory=set)

    def gathered(self, t: torch.Tensor, spec) -> torch.Tensor:
        return gathered(t, spec, self.scan.mesh, self.scan.dtype)

    def forward(self, h, layer):
        mesh, activation = self.scan.mesh, self.activation
        params = {name: self.gathered(t, self.specs[name]) for name, t in layer["params"].items()}
        layer = {**layer, "params": params}
        if "ve" in layer:
            annotate(layer["ve"], mesh, activation)
        annotate(h, mesh, activation)
        h, y = self.partitioned_forward(h, layer)
        annotate(h, mesh, activation)
        return h, y

    def backward(self, grad_h, saved):
        mesh, activation, specs = self.scan.mesh, self.activation, self.specs
        grad_y, activations = saved
        activations = list(activations)
        for i, name in self.saved_weights.items():
            activations[i] = self.gathered(activations[i], specs[name])
        annotate(grad_h, mesh, activation)
        grad_h, grad_layer = self.partitioned_backward(grad_h, (grad_y, activations))
        annotate(grad_h, mesh, activation)
        grads = grad_layer["params"]
        for name, g in grads.items():
            if specs[name] is not None:  # summed over the batch and sharded
                if name not in self.reduced:  # by the partitioner: whole, then cut
                    annotate(g, mesh, (None,) * g.dim())
                annotate(g, mesh, specs[name])
            # widened to the weight's dtype on the shard, after the reduction: a convert between
            # the all-reduce and its slice keeps a TPU from making them one reduce-scatter
            grads[name] = g.to(self.stacked[name].dtype)
        if grad_layer.get("ve") is not None:
            annotate(grad_layer["ve"], mesh, activation)
        return grad_h, grad_layer

    def remember(self, activations):
        leaves = {id(t): name for name, t in self.stacked.items()}
        self.saved_weights.update(
            {i: leaves[id(a)] for i, a in enumerate(activations) if id(a) in leaves}
        )


def gathered(t: torch.Tensor, spec, mesh, dtype: torch.dtype | None) -> torch.Tensor:
    """A weight slice: sharded as its parameter, cast to the compute dtype `dtype` on the shard,
    then whole (the layer's all-gather here). Under autocast the layer casts every weight to that
    dtype before any use, so the cast moves no result, and the gather moves half the bytes."""
    if spec is None:
        return t
    annotate(t, mesh, spec)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    annotate(t, mesh, (None,) * t.dim())
    return t


def _partition_reducing(joint, inputs, narrow, reducers: dict, by_hand: set, **kwargs):
    """_partition_saving_inputs, then the gradients at `reducers`' places reduced by hand in the
    backward graph (_reduce_by_hand); the places it replaced are added to `by_hand`."""
    fwd, bwd = _partition_saving_inputs(joint, inputs, narrow=narrow, **kwargs)
    by_hand.update(_reduce_by_hand(bwd, reducers))
    return fwd, bwd


def _partition_saving_inputs(joint, inputs, narrow=(), **kwargs):
    """min_cut_rematerialization_partition, then every saved activation that is only a view or
    a cast of a layer input (a weight's transpose transposed back, t(t(W)); its bf16 copy under
    autocast) saved as that input instead, the views and casts redone in the backward. Why:
    torch_xla's scan stacks every saved activation over the layers, and tells a saved input
    (kept by reference: the stacked sharded weight) by identity only; a view of a weight would be
    stacked as the whole gathered weight of every layer. The gradients of the inputs at places
    `narrow` leave the backward without autocast's widening cast (_narrow_gradients)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    fwd, bwd = min_cut_rematerialization_partition(joint, inputs, **kwargs)
    _narrow_gradients(bwd, narrow)
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


def _narrow_gradients(bwd, places) -> None:
    """The backward graph's gradients at `places` (of its outputs, one per layer input) returned
    as computed, in the compute dtype, where autocast's cast of a weight made the last op a
    widening cast to fp32: the caller reduces them first and widens each on its shard."""
    (output,) = [n for n in bwd.graph.nodes if n.op == "output"]
    outs = list(output.args[0])
    changed = False
    for i in places:
        node = outs[i]
        if not (
            isinstance(node, torch.fx.Node)
            and node.target is torch.ops.aten._to_copy.default
            and node.kwargs.get("dtype") == torch.float32
        ):
            continue
        source = node.args[0]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if value is not None and value.dtype in (torch.bfloat16, torch.float16):
            outs[i] = source
            changed = True
    if changed:
        output.args = (type(output.args[0])(outs),)
        bwd.graph.eliminate_dead_code()
        bwd.graph.lint()
        bwd.recompile()


def _reduce_by_hand(bwd, reducers: dict) -> set[int]:
    """Each weight gradient at `reducers`' places (output index -> WeightGradReducer) that the
    backward graph computes as mm(t(a), b), seen through an even number of transposes (the
    tokens contracted: a [N, m], b [N, n]), computed by its reducer instead: summed over the
    devices and sharded as its weight. Returns the places so replaced."""
    aten = torch.ops.aten
    (output,) = [n for n in bwd.graph.nodes if n.op == "output"]
    outs = list(output.args[0])
    done = set()
    for i, reducer in reducers.items():
        node, flips = outs[i], 0
        while isinstance(node, torch.fx.Node) and node.target is aten.t.default:
            node, flips = node.args[0], flips + 1
        if flips % 2 or not (isinstance(node, torch.fx.Node) and node.target is aten.mm.default):
            continue
        left, right = node.args
        if not (isinstance(left, torch.fx.Node) and left.target is aten.t.default):
            continue
        a, b = left.args[0], right
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
            continue
        if a.meta["val"].shape[0] != b.meta["val"].shape[0]:
            continue
        name = f"reduce_scatter_{i}"
        bwd.add_submodule(name, reducer)
        with bwd.graph.inserting_before(node):
            reduced = bwd.graph.call_module(name, (a, b))
        reduced.meta = dict(node.meta)
        node.replace_all_uses_with(reduced)
        bwd.graph.erase_node(node)
        done.add(i)
    if done:
        bwd.graph.eliminate_dead_code()
        bwd.graph.lint()
        bwd.recompile()
    return done


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
