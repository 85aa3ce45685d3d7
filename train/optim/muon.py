"""Muon for the blocks' 2-D weights, AdamW for everything else (train.optimizer=muon).

    update = orthogonalize(nesterov_momentum(grad))      # ~ U V^T of the momentum's SVD
    W -= lr * sqrt(max(1, rows / cols)) * update

Every direction of the momentum moves the weights by the same amount, so rare directions are not
drowned by the dominant ones. The matrices are grouped by shape, each group one stacked
Newton-Schulz iteration, and each matrix is orthogonalised once in the job: on its owner rank, or
split over the chips under XLA SPMD. How, and why: docs/training.md, "How Muon runs".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from codex.model.gpt import STACKED
from codex.train.plan.owners import balanced_owners, wide

# modded-nanogpt's quintic: fast growth of small singular values
NS_COEFFS = (
    3.4445,
    -4.7750,
    2.0315,
)


def orthogonalize(
    g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The semi-orthogonal factor of `g` ([..., rows, cols]) by `steps` Newton-Schulz iterations."""
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:  # iterate on the wide orientation: X X^T is the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def newton_schulz(x: torch.Tensor, steps: int) -> torch.Tensor:
    """`orthogonalize` over a stack: x [n, rows, cols] with rows <= cols, in the iteration's dtype.
    x is the caller's scratch: normalised in place, then it and one more stack take turns holding
    the iteration (its own buffer may be the result), so a step holds two stacks and two
    [n, rows, rows] products, not a new stack per step while the caller still holds x."""
    a, b, c = NS_COEFFS
    x = x.div_(x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    other = torch.empty_like(x)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G G
        del gram
        torch.baddbmm(x, poly, x, beta=a, out=other)  # a X + (b G + c G G) X
        x, other = other, x
    return x


@functools.cache
def _compiled_newton_schulz() -> Callable[[torch.Tensor, int], torch.Tensor]:
    # one program per stack shape (a model has a few); not dynamic: fixed shapes tune best
    return cast(
        Callable[[torch.Tensor, int], torch.Tensor],
        torch.compile(newton_schulz, fullgraph=True, dynamic=False),
    )


@functools.cache
def _layout(
    shapes: tuple[tuple[int, int], ...], world: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(the matrices' indices grouped by wide shape, in order of first appearance; each matrix's
    owner rank), for matrices of `shapes` shared over `world` ranks."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(wide(shape), []).append(i)
    owners = balanced_owners([r * c for r, c in shapes], world)
    return tuple(tuple(g) for g in groups.values()), tuple(owners)


def _as_wide(m: torch.Tensor) -> torch.Tensor:
    """`m` in its wide orientation (a transposed view when tall)."""
    return m.mT if m.size(-2) > m.size(-1) else m


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update is orthogonalised (2-D parameters only).

    shard_across=(rank, world): this process orthogonalises only the matrices it owns and gathers
    the rest from its peers over the default process group (replicated data parallelism).
    compiled: the stacked iteration torch.compile'd (CUDA)."""

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
        shard_across: tuple[int, int] | None = None,
        compiled: bool = False,
    ):
        """8 parameters: the hyperparameters, as every torch.optim constructor takes them, and
        where and how the iteration runs."""
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self.rank, self.world = shard_across or (0, 1)
        self.compiled = compiled
        # XLA SPMD: place_stack(stack, split) marks a [n, rows, cols] stack split over the devices
        # along dim 0 (split), or as the iterated result is to be held (replicated; under fsdp
        # split along its rows); place_update(update, p) gives an update p's sharding (fsdp).
        # train/xla/update.py sets them while it traces the step
        self.place_stack: Callable[[torch.Tensor, bool], None] | None = None
        self.place_update: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2 and not (p.ndim == 3 and shard_across is None):
                    raise ValueError(
                        f"Muon is for 2-D weights (or one process's stacks of them); "
                        f"got a parameter of shape {tuple(p.shape)}"
                    )

    def _momentum(self, p: torch.Tensor, momentum: float) -> torch.Tensor:
        """p's momentum buffer, updated in place with its gradient (every rank keeps and saves the
        whole momentum, or its shard under fsdp)."""
        grad = cast(torch.Tensor, p.grad)  # step() passes only parameters with a gradient
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        return state["momentum_buffer"].lerp_(grad, 1 - momentum)

    def _blended(self, params: list[torch.Tensor], momentum: float, i: int) -> torch.Tensor:
        """Nesterov: params[i]'s momentum updated, and the gradient blended with it."""
        buffer = self._momentum(params[i], momentum)
        return cast(torch.Tensor, params[i].grad).lerp(buffer, momentum)

    def _iterate(self, stack: torch.Tensor, steps: int) -> torch.Tensor:
        """newton_schulz over one group's stack: compiled on CUDA, split over the chips on XLA."""
        if self.place_stack is not None:
            self.place_stack(stack, True)
        iterate = _compiled_newton_schulz() if self.compiled else newton_schulz
        out = iterate(stack, steps)
        if self.place_stack is not None:
            self.place_stack(out, False)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            steps, momentum = group["ns_steps"], group["momentum"]
            if isinstance(params[0], DTensor):
                updates = _owner_updates(
                    cast(list[DTensor], params),
                    functools.partial(self._blended, params, momentum),
                    functools.partial(self._iterate, steps=steps),
                    self.ns_dtype,
                )
            elif any(p.ndim == 3 for p in params):
                updates = self._stacked_updates(params, momentum, steps)
            else:
                updates = self._replicated_updates(params, momentum, steps)
            lr, wd = group["lr"], group["weight_decay"]
            for i, p in enumerate(params):
                if wd:
                    p.mul_(1 - lr * wd)
                # Same RMS update size whatever the aspect ratio: a tall matrix's U V^T has smaller
                # entries.
                scale = -lr * max(1.0, p.size(-2) / p.size(-1)) ** 0.5
                if self.place_update is not None:
                    self.place_update(updates[i], p)
                update = updates[i].to(p.dtype)
                if isinstance(scale, torch.Tensor):  # a device lr (train/xla/update.py)
                    p.add_(update * scale)
                else:
                    p.add_(update, alpha=scale)

    def _stacked_updates(
        self, params: list[torch.Tensor], momentum: float, steps: int
    ) -> dict[int, torch.Tensor]:
        """Every parameter's update where some are stacks of matrices [n, rows, cols] (one block
        weight of every layer, kept stacked: XLA fsdp), in one process: each wide shape's matrices
        iterated as one stack made of whole parameters (each orthogonalised on its own, as
        _replicated_updates does), the update of a stack a stack."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault(wide(p.shape[-2:]), []).append(i)
        out: dict[int, torch.Tensor] = {}
        for members in groups.values():
            parts = []
            for i in members:
                blended = _as_wide(self._blended(params, momentum, i)).to(self.ns_dtype)
                parts.append(blended if blended.ndim == 3 else blended.unsqueeze(0))
            stack = torch.cat(parts) if len(parts) > 1 else parts[0]
            iterated = self._iterate(stack, steps)
            start = 0
            for i, part in zip(members, parts, strict=True):
                update = iterated[start : start + part.size(0)]
                start += part.size(0)
                p = params[i]
                update = update.mT if p.size(-2) > p.size(-1) else update
                out[i] = update if p.ndim == 3 else update[0]
        return out

    def _replicated_updates(
        self, params: list[torch.Tensor], momentum: float, steps: int
    ) -> dict[int, torch.Tensor]:
        """Every matrix's update (in the iteration's dtype), each iterated on its owner rank, one
        stack per group, and all_gathered when several ranks share the work. A matrix another rank
        owns needs only its momentum updated here."""
        groups, owner = _layout(tuple((p.size(0), p.size(1)) for p in params), self.world)
        mine: dict[int, torch.Tensor] = {}
        for members in groups:
            own = [i for i in members if owner[i] == self.rank]
            for i in members:
                if owner[i] != self.rank:
                    self._momentum(params[i], momentum)
            if not own:
                continue
            ref = params[own[0]]
            # filled one blended gradient at a time, so no more than one is alive beside it
            stack = ref.new_empty((len(own), *wide(ref.shape)), dtype=self.ns_dtype)
            for j, i in enumerate(own):
                stack[j].copy_(_as_wide(self._blended(params, momentum, i)))
            out = self._iterate(stack, steps)
            del stack
            for j, i in enumerate(own):
                mine[i] = out[j].mT if params[i].size(0) > params[i].size(1) else out[j]
        if self.world == 1:
            return mine
        return _gather_updates(mine, params, owner, self.rank, self.world, self.ns_dtype)


def _owner_updates(
    params: list[DTensor],
    blended: Callable[[int], torch.Tensor],
    iterate: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
) -> dict[int, torch.Tensor]:
    """Sharded (fsdp) matrices, each orthogonalised once, on its owner rank of the shard group
    (`balanced_owners`), its update sliced back to every rank. One all_to_all sends every rank's
    row shards of the momentum-blended gradients (`blended(i)`, called once per matrix) to their
    owners, in `dtype` (the iteration's own); each owner puts its matrices of a group together as
    one stack (a tall one transposed), iterates on it once (`iterate`), writes each update's row
    shards over what it received, and a second all_to_all sends that buffer back. Returns
    {i: update as a DTensor laid out as params[i]}. Under HSDP every replica group does this alike.
    The two exchanges share their bookkeeping (_RowExchange), so they stay mirror images.

    What it holds (train/plan/memory.py's step buffers): the send and receive buffers during the
    first exchange; while iterating, the receive buffer and one group's stack of this owner's
    matrices twice over (the stack and the iteration's next value) with two [n, rows, rows] Gram
    products; the receive buffer and the returned shards during the second exchange."""
    exchange = _RowExchange.of(params, _shard_group(params))
    tall = [p.shape[0] > p.shape[1] for p in params]
    send = exchange.pack(blended, dtype, params[0].to_local().device)
    received = _all_to_all(send, exchange.mine_sizes, exchange.theirs_sizes, exchange.group)
    del send
    for members in exchange.groups:
        mine = [i for i in members if exchange.owner[i] == exchange.rank]
        if not mine:
            continue
        stack = received.new_empty((len(mine), *wide(params[mine[0]].shape)))
        for j, i in enumerate(mine):
            for got, dst in exchange.pieces(received, i, stack[j].mT if tall[i] else stack[j]):
                dst.copy_(got)
        out = iterate(stack)
        del stack
        for j, i in enumerate(mine):
            for dst, got in exchange.pieces(received, i, out[j].mT if tall[i] else out[j]):
                dst.copy_(got)
        del out
    back = _all_to_all(received, exchange.theirs_sizes, exchange.mine_sizes, exchange.group)
    del received
    return exchange.unpack(back, params)


def _shard_group(params: list[DTensor]):
    """The process group fsdp shards the matrices' rows over (one mesh dim, Shard(0) each)."""
    ref = params[0]
    placements = ref.placements
    shard_dims = [d for d, pl in enumerate(placements) if isinstance(pl, Shard)]
    if len(shard_dims) != 1 or any(
        p.placements != placements or p.placements[shard_dims[0]] != Shard(0) for p in params
    ):
        raise ValueError("Muon under fsdp expects every matrix sharded on dim 0 over one mesh dim")
    return ref.device_mesh.get_group(shard_dims[0])


@dataclass(frozen=True)
class _RowExchange:
    """Where every rank's row shards of the matrices sit in _owner_updates' two exchanges: to
    the owners (each rank's shards, grouped by owner) and back (the same buffer, mirrored)."""

    group: Any  # the shard group
    rank: int
    world: int
    groups: tuple[tuple[int, ...], ...]  # the matrices' indices by wide shape
    owner: tuple[int, ...]  # each matrix's owner rank
    rows: list[list[int]]  # rows[i][q]: rank q's rows of matrix i
    cols: list[int]
    owned: list[list[int]]  # every owner's matrices, group by group: the buffers' order
    mine_sizes: list[int]  # my shards, per owner q
    theirs_sizes: list[int]  # rank q's shards of my matrices
    # where[i][q] = (offset, first row) of sender q's rows of my matrix i, in the received buffer
    where: dict[int, list[tuple[int, int]]]

    @classmethod
    def of(cls, params: list[DTensor], group) -> _RowExchange:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        groups, owner = _layout(tuple((p.shape[0], p.shape[1]) for p in params), world)
        rows = [_row_split(p.shape[0], world) for p in params]
        cols = [p.shape[1] for p in params]
        owned = [[i for g in groups for i in g if owner[i] == q] for q in range(world)]

        def numel(q: int, holder: int) -> int:
            """Elements of rank `holder`'s row shards of the matrices rank q owns."""
            return sum(rows[i][holder] * cols[i] for i in owned[q])

        theirs_sizes = [numel(rank, q) for q in range(world)]
        # the received buffer holds, per sender q, its rows of each of my matrices in order
        where: dict[int, list[tuple[int, int]]] = {i: [] for i in owned[rank]}
        for q in range(world):
            offset = sum(theirs_sizes[:q])
            for i in owned[rank]:
                where[i].append((offset, sum(rows[i][:q])))
                offset += rows[i][q] * cols[i]
        mine_sizes = [numel(q, rank) for q in range(world)]
        return cls(
            group, rank, world, groups, owner, rows, cols, owned, mine_sizes, theirs_sizes, where
        )

    def pack(
        self, blended: Callable[[int], torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """To the owners: this rank's row shards of the blended gradients, grouped by owner."""
        send = torch.empty(sum(self.mine_sizes), dtype=dtype, device=device)
        offset = 0
        for i in (i for q in self.owned for i in q):
            n = self.rows[i][self.rank] * self.cols[i]
            send[offset : offset + n].copy_(cast(DTensor, blended(i)).to_local().reshape(-1))
            offset += n
        return send

    def pieces(self, buffer: torch.Tensor, i: int, whole: torch.Tensor):
        """(sender q's rows of matrix i in `buffer` (as received), the same rows of `whole`), for
        every sender q: [rows, cols] views."""
        for q, (a, first) in enumerate(self.where[i]):
            n = self.rows[i][q]
            yield buffer[a : a + n * self.cols[i]].view(n, self.cols[i]), whole[first : first + n]

    def unpack(self, back: torch.Tensor, params: list[DTensor]) -> dict[int, torch.Tensor]:
        """The updates sent back, each as a DTensor laid out as its parameter."""
        ref = params[0]
        mesh, placements = ref.device_mesh, ref.placements
        updates: dict[int, torch.Tensor] = {}
        offset = 0
        for i in (i for q in self.owned for i in q):
            p = params[i]
            n = self.rows[i][self.rank] * self.cols[i]
            piece = back[offset : offset + n].view(self.rows[i][self.rank], self.cols[i])
            offset += n
            updates[i] = DTensor.from_local(
                piece, mesh, placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        return updates


def _row_split(n: int, world: int) -> list[int]:
    """The rows each of `world` ranks holds of a dim of n under Shard(0) (torch.chunk's split:
    ceil(n / world) each, the last ones short or empty)."""
    chunk = -(-n // world)
    return [max(0, min(chunk, n - q * chunk)) for q in range(world)]


def _all_to_all(send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group):
    recv = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    return recv


def _gather_updates(
    mine: dict[int, torch.Tensor],
    params: list[torch.Tensor],
    owner: Sequence[int],
    rank: int,
    world: int,
    dtype: torch.dtype,
) -> dict[int, torch.Tensor]:
    """Every rank's updates on every rank: each rank sends its own (`mine`, the matrices `owner`
    gives it) flattened into one buffer in `dtype` (the iteration's), padded to the largest share;
    one all_gather in all."""
    shares = [[i for i in range(len(params)) if owner[i] == r] for r in range(world)]
    width = max(sum(params[i].numel() for i in share) for share in shares)
    ref = params[0]
    send = torch.zeros(width, dtype=dtype, device=ref.device)
    if mine:
        flat = torch.cat([mine[i].reshape(-1) for i in shares[rank]])
        send[: flat.numel()] = flat
    received = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(received, send)
    updates = {}
    for r, share in enumerate(shares):
        offset = 0
        for i in share:
            n = params[i].numel()
            updates[i] = received[r][offset : offset + n].view_as(params[i])
            offset += n
    return updates


class Optimizers:
    """Several optimizers stepped as one: what the loop and checkpoints use (step, zero_grad,
    param_groups, state_dict, load_state_dict)."""

    def __init__(self, **optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, saved: dict) -> None:
        for name, opt in self.optimizers.items():
            opt.load_state_dict(saved[name])


def is_hidden_matrix(name: str, p: torch.nn.Parameter) -> bool:
    """A block's 2-D weight (attention and MLP projections): what Muon updates; or the stack of
    one such weight of every block, [n_layer, rows, cols] (model/gpt.py: STACKED)."""
    if name.startswith(STACKED + "."):
        return p.ndim == 3
    return p.ndim == 2 and name.startswith("blocks.")
