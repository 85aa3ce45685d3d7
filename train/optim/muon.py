"""Muon for the blocks' 2-D weights, AdamW for everything else (train.optimizer=muon).

    update = orthogonalize(nesterov_momentum(grad))      # ~ U V^T of the momentum's SVD
    W -= lr * sqrt(max(1, rows / cols)) * update

Muon (Keller Jordan, 2024; modded-nanogpt's record log, nanochat) replaces a matrix's update by
the nearest semi-orthogonal matrix: every direction of the momentum moves the weights by the same
amount, so rare directions are not drowned by the dominant ones. The orthogonalisation is a
quintic Newton-Schulz iteration (5 steps, coefficients tuned for speed, not convergence): the
singular values of the result land in about [0.7, 1.2] instead of exactly 1, which the method
tolerates. It is plain tensor algebra, so it runs inside XLA's one graph per step with no host
round trip. Embeddings, the output head, norms and scalars are not hidden-layer matrices; they
keep AdamW at train.lr.

Dtypes: the iteration runs in bf16 where training computes in bf16 (CUDA, TPU), in fp32 on the
CPU, so the equivalence tests (1 process = 2 processes = accumulation) hold to 1e-5.

Layouts: with replicated weights (CPU/CUDA processes) every rank holds the all-reduced gradient
and the whole momentum, but each matrix is orthogonalised once: rank r takes matrices r, r + W,
r + 2W, ... and one all_gather per step hands every rank every update (modded-nanogpt's scheme), so
the Newton-Schulz cost per rank falls as 1/W. Ranks apply the same gathered updates, so weights stay
identical. Under XLA SPMD the step is one graph over replicated tensors and the partitioner places
the work; `shard_across` is None there. With sharded weights (train.parallel=fsdp, DTensors) each
matrix is orthogonalised once too, on its owner rank of the shard group (matrix i on rank i mod W):
one all_to_all sends every rank's row shards of the momentum-blended gradients to the owners (in
the iteration's dtype, bf16 where training is bf16), and one sends each owner's update back as row
shards (`_owner_updates`; under HSDP each replica group does the same).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

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


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update is orthogonalised (2-D parameters only).

    shard_across=(rank, world): this process orthogonalises only its share of the matrices and
    gathers the rest from its peers over the default process group (replicated data parallelism)."""

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
        shard_across: tuple[int, int] | None = None,
    ):
        """7 parameters: the hyperparameters, as every torch.optim constructor takes them."""
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self.rank, self.world = shard_across or (0, 1)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon is for 2-D weights; got a parameter of shape {tuple(p.shape)}"
                    )

    def _blended(self, params: list[torch.Tensor], momentum: float, i: int) -> torch.Tensor:
        """Nesterov: params[i]'s momentum updated in place (every rank keeps and saves the whole
        momentum, or its shard under fsdp), and the gradient blended with it."""
        p = params[i]
        grad = cast(torch.Tensor, p.grad)  # step() passes only parameters with a gradient
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        state["momentum_buffer"].lerp_(grad, 1 - momentum)
        return grad.lerp(state["momentum_buffer"], momentum)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            steps = group["ns_steps"]
            blended = functools.partial(self._blended, params, group["momentum"])
            if isinstance(params[0], DTensor):
                updates = _owner_updates(cast(list[DTensor], params), blended, steps, self.ns_dtype)
            else:
                # one matrix blended at a time; a matrix another rank owns needs only its momentum
                mine = {}
                for i in range(len(params)):
                    b = blended(i)
                    if i % self.world == self.rank:
                        mine[i] = orthogonalize(b, steps, self.ns_dtype)
                updates = (
                    mine
                    if self.world == 1
                    else _gather_updates(mine, params, self.rank, self.world)
                )
            lr, wd = group["lr"], group["weight_decay"]
            for i, p in enumerate(params):
                if wd:
                    p.mul_(1 - lr * wd)
                # Same RMS update size whatever the aspect ratio: a tall matrix's U V^T has smaller
                # entries.
                scale = -lr * max(1.0, p.size(-2) / p.size(-1)) ** 0.5
                if isinstance(scale, torch.Tensor):  # a device lr (train/xla/update.py)
                    p.add_(updates[i] * scale)
                else:
                    p.add_(updates[i], alpha=scale)


def _owner_updates(
    params: list[DTensor], blended: Callable[[int], torch.Tensor], steps: int, dtype: torch.dtype
) -> dict[int, torch.Tensor]:
    """Sharded (fsdp) matrices, each orthogonalised once, on its owner rank (matrix i on rank
    i mod W of the shard group), its update sliced back to every rank. One all_to_all sends every
    rank's row shards of the momentum-blended gradients (`blended(i)`, called once per matrix)
    to their owners, in `dtype` (the iteration's own); each owner orthogonalises one matrix at a
    time and writes the update's row shards over what it received, and a second all_to_all sends
    that buffer back. Returns {i: update as a DTensor laid out as params[i]}. Under HSDP every
    replica group does this alike.

    One function (68 lines) because the two exchanges share its bookkeeping (rows, owners,
    sizes per rank) and must stay mirror images of each other.

    What it holds (train/plan/memory.py's step buffers): the send and receive buffers during the
    first exchange, the receive buffer and one whole matrix with its iteration's temporaries
    while orthogonalising, the receive buffer and the returned shards during the second."""
    ref = params[0]
    mesh, placements = ref.device_mesh, ref.placements
    shard_dims = [d for d, pl in enumerate(placements) if isinstance(pl, Shard)]
    if len(shard_dims) != 1 or any(
        p.placements != placements or p.placements[shard_dims[0]] != Shard(0) for p in params
    ):
        raise ValueError("Muon under fsdp expects every matrix sharded on dim 0 over one mesh dim")
    group = mesh.get_group(shard_dims[0])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = [_row_split(p.shape[0], world) for p in params]
    cols = [p.shape[1] for p in params]
    owned = [[i for i in range(len(params)) if i % world == q] for q in range(world)]

    def numel(q: int, holder: int) -> int:
        """Elements of rank `holder`'s row shards of the matrices rank q owns."""
        return sum(rows[i][holder] * cols[i] for i in owned[q])

    mine_sizes = [numel(q, rank) for q in range(world)]  # my shards, per owner q
    theirs_sizes = [numel(rank, q) for q in range(world)]  # rank q's shards of my matrices
    # to the owners: this rank's row shards of the blended gradients, grouped by owner
    send = torch.empty(sum(mine_sizes), dtype=dtype, device=ref.to_local().device)
    offset = 0
    for i in (i for q in owned for i in q):
        n = rows[i][rank] * cols[i]
        send[offset : offset + n].copy_(cast(DTensor, blended(i)).to_local().reshape(-1))
        offset += n
    received = _all_to_all(send, mine_sizes, theirs_sizes, group)
    del send
    # received holds, per sender q, its rows of each of my matrices: gather a matrix whole,
    # orthogonalise it, and put each sender's rows of the update where its rows came from
    bases = [sum(theirs_sizes[:q]) for q in range(world)]
    for i in owned[rank]:
        where = [(bases[q], rows[i][q] * cols[i]) for q in range(world)]
        whole = torch.cat([received[a : a + n] for a, n in where]).view(-1, cols[i])
        update = orthogonalize(whole, steps, dtype).reshape(-1)
        del whole
        done = 0
        for q, (a, n) in enumerate(where):
            received[a : a + n].copy_(update[done : done + n])
            done += n
            bases[q] += n
    back = _all_to_all(received, theirs_sizes, mine_sizes, group)
    del received
    updates: dict[int, torch.Tensor] = {}
    offset = 0
    for i in (i for q in owned for i in q):
        p = params[i]
        n = rows[i][rank] * cols[i]
        piece = back[offset : offset + n].view(rows[i][rank], cols[i]).to(p.dtype)
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
    mine: dict[int, torch.Tensor], params: list[torch.Tensor], rank: int, world: int
) -> dict[int, torch.Tensor]:
    """Every rank's orthogonalised matrices on every rank: rank r owns params[r::world]; each sends
    its updates flattened into one buffer padded to the largest share, one all_gather in all."""
    shares = [list(range(r, len(params), world)) for r in range(world)]
    width = max(sum(params[i].numel() for i in share) for share in shares)
    ref = params[0]
    send = torch.zeros(width, dtype=ref.dtype, device=ref.device)
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
    """A block's 2-D weight (attention and MLP projections): what Muon updates."""
    return p.ndim == 2 and name.startswith("blocks.")
