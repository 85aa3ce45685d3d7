"""The optimizer (AdamW, or Muon + AdamW: train/optim/muon.py) with the usual parameter groups,
gradient clipping, and loading a saved optimizer state. The learning rate is
train/optim/schedule.py.

Weight decay applies to matrices only: embeddings, norms (weights and biases) and every other
1-D parameter (biases, scalar gains) are excluded, as in GPT-2/nanoGPT practice: decaying a norm
gain or an embedding row pulls it towards zero for no regularisation benefit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from codex.core.config import ConfigError
from codex.model.gpt import STACKED
from codex.train.optim.muon import Muon, Optimizers, is_hidden_matrix


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """[{params with decay}, {params without}]. Tied weights appear once (named_parameters
    dedups)."""
    no_decay_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            no_decay_ids.add(id(module.weight))
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        is_norm = "norm" in name.lower() or "ln_" in name.lower()
        stacked = name.startswith(STACKED + ".")  # [n_layer, ...]: one weight of every block
        if (
            p.ndim - stacked < 2
            or id(p) in no_decay_ids
            or is_norm
            or "wte" in name.split(".")
            or leaf == "bias"
        ):
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(
    model: torch.nn.Module, tcfg, hardware: str = "cpu", compute_dtype: torch.dtype | None = None
) -> torch.optim.Optimizer | Optimizers:
    """train.optimizer over `model` for a backend of kind `hardware` (cpu, cuda, tpu): AdamW, or
    Muon for the blocks' matrices (its iteration in `compute_dtype`, fp32 when None; compiled on
    CUDA under train.compile) plus AdamW for the rest. The lr set here is replaced every step by
    set_lr(lr_for(...))."""
    if tcfg.optimizer == "muon":
        hidden = [
            p for n, p in model.named_parameters() if p.requires_grad and is_hidden_matrix(n, p)
        ]
        hidden_ids = {id(p) for p in hidden}
        muon = Muon(
            hidden,
            lr=tcfg.muon_lr,
            momentum=tcfg.muon_momentum,
            ns_dtype=compute_dtype or torch.float32,
            shard_across=None
            if any(isinstance(p, DTensor) for p in hidden)
            else _replica_ranks(hardware),
            # as the model is: the stacked iteration's few shapes each compile once
            compiled=hardware == "cuda" and tcfg.compile,
        )
        for group in muon.param_groups:
            # set_lr: the schedule scales both peaks alike
            group["lr_ratio"] = tcfg.muon_lr / tcfg.lr
        return Optimizers(muon=muon, adamw=_adamw(model, tcfg, hardware, exclude=hidden_ids))
    return _adamw(model, tcfg, hardware)


def _replica_ranks(hardware: str) -> tuple[int, int] | None:
    """(rank, world) of the CPU/CUDA data-parallel processes, over which Muon shares out its
    orthogonalisations; None for one process and for XLA, whose SPMD step is one graph."""
    if hardware == "tpu" or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.get_rank(), dist.get_world_size()


def _adamw(
    model: torch.nn.Module, tcfg, hardware: str, exclude: frozenset[int] | set[int] = frozenset()
) -> torch.optim.AdamW:
    kwargs = {}
    if hardware == "cuda":
        kwargs["fused"] = True  # one kernel for all parameters
    elif hardware == "tpu":
        # The step count stays a device tensor. Otherwise AdamW computes its bias corrections on
        # the host, and 1 - beta2**step rounds to exactly 1.0 in fp32 near step 325 (beta2 0.95):
        # a constant baked into a new graph, one more compilation mid-run.
        kwargs["capturable"] = True
    groups = [
        {**g, "params": [p for p in g["params"] if id(p) not in exclude]}
        for g in param_groups(model, tcfg.weight_decay)
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=tcfg.lr,
        betas=(tcfg.beta1, tcfg.beta2),
        eps=1e-8,
        **kwargs,
    )


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm (call after the all-reduce), clipped to max_norm; <= 0 measures
    only. Sharded (fsdp) gradients: the norm over every shard (DTensor.full_tensor sums the
    squares)."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm if max_norm > 0 else float("inf"), total)
    return total


def load_optimizer_state(optimizer, saved: dict) -> None:
    """Load a checkpoint's optimizer state, keeping this optimizer's implementation flags: a state
    saved by a capturable AdamW (XLA) or a fused one (CUDA) resumes on the CPU and the reverse."""
    mine = set(optimizer.optimizers) if isinstance(optimizer, Optimizers) else None
    theirs = None if "param_groups" in saved else set(saved)
    if mine != theirs:

        def name(s):
            return "muon" if s else "adamw"

        raise ConfigError(
            f"the checkpoint's optimizer state is for train.optimizer={name(theirs)}, "
            f"this run uses {name(mine)}: resume with the same optimizer or use a new --run"
        )
    if mine:
        for key, opt in optimizer.optimizers.items():
            _load_one(opt, saved[key])
    else:
        _load_one(optimizer, saved)


def _load_one(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    flags = ("capturable", "fused", "foreach", "differentiable")
    groups = [
        {**g, **{k: cur[k] for k in flags if k in cur}}
        for g, cur in zip(saved["param_groups"], optimizer.param_groups, strict=False)
    ]
    optimizer.load_state_dict({**saved, "param_groups": groups})
