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

Layouts: with replicated weights every rank holds the all-reduced gradient and computes the same
update (the orthogonalisation is repeated on every rank: cheap next to forward and backward at
codex's sizes). With sharded weights (train.parallel=fsdp) each rank all-gathers the matrix's
momentum-blended gradient, orthogonalises the whole matrix and keeps its own slice of the update.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

NS_COEFFS = (3.4445, -4.7750, 2.0315)   # modded-nanogpt's quintic: fast growth of small singular values


def orthogonalize(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The semi-orthogonal factor of `g` ([..., rows, cols]) by `steps` Newton-Schulz iterations."""
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:  # iterate on the wide orientation: X X^T is the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)   # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update is orthogonalised (2-D parameters only)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 ns_steps: int = 5, ns_dtype: torch.dtype = torch.float32):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon is for 2-D weights; got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                update = orthogonalize(_full(p.grad.lerp(buf, mom)), group["ns_steps"], self.ns_dtype)
                update = _like(update, p)
                if wd:
                    p.mul_(1 - lr * wd)
                # Same RMS update size whatever the aspect ratio: a tall matrix's U V^T has smaller entries.
                p.add_(update, alpha=-lr * max(1.0, p.size(-2) / p.size(-1)) ** 0.5)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded (fsdp DTensor) matrix all-gathered: the orthogonalisation needs the whole matrix."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(update: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The full `update` laid out as `p`: this rank's slice of it when p is sharded (no communication)."""
    if not isinstance(p, DTensor):
        return update
    return distribute_tensor(update, p.device_mesh, p.placements, src_data_rank=None)


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
