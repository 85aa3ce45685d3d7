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
the work; `shard_across` is None there. With sharded weights (train.parallel=fsdp, DTensors) every
rank all-gathers a matrix's momentum-blended gradient, orthogonalises the whole matrix and keeps its
own slice of the update (`shard_across` is None there too: the matrices are not replicated).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

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

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            mine = {}
            for i, p in enumerate(params):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                # every rank keeps (and saves) the whole momentum
                buf.lerp_(p.grad, 1 - group["momentum"])
                if i % self.world == self.rank:
                    mine[i] = _like(
                        orthogonalize(
                            _full(p.grad.lerp(buf, group["momentum"])),
                            group["ns_steps"],
                            self.ns_dtype,
                        ),
                        p,
                    )
            updates = (
                mine if self.world == 1 else _gather_updates(mine, params, self.rank, self.world)
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


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded (fsdp DTensor) matrix all-gathered: the orthogonalisation needs the whole
    matrix."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(update: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The full `update` laid out as `p`: this rank's slice of it when p is sharded (no
    communication)."""
    if not isinstance(p, DTensor):
        return update
    return distribute_tensor(update, p.device_mesh, p.placements, src_data_rank=None)


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
