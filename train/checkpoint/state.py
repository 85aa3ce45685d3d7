"""The whole training state in a checkpoint (train/checkpoint/folders.py): built by `save_training`
on every rank, put back by `restore_training` on every rank, so the loop never touches its keys.

The tree holds the model, the optimizer state keyed by parameter name (fqn: it loads into any
layout), each rank's RNG, the counters, the loader, the config and what a resume checks. The tree
in full, and why not torch's get/set_optimizer_state_dict: docs/checkpoints.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

import codex
from codex.core import rundir
from codex.core.config import ConfigError, to_dict
from codex.model.gpt import STACKED
from codex.train.checkpoint import async_save, xla_shards
from codex.train.checkpoint import dcp as dcp_io
from codex.train.checkpoint import folders as checkpoint
from codex.train.optim.muon import Optimizers
from codex.train.optim.optimizer import load_optimizer_state

log = logging.getLogger("codex.checkpoint")


def optimizer_parts(optimizer) -> dict[str, torch.optim.Optimizer]:
    return dict(optimizer.optimizers) if isinstance(optimizer, Optimizers) else {"adamw": optimizer}


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _local(t: torch.Tensor) -> torch.Tensor | xla_shards.HostShards:
    """A tensor where it is when DCP can write it from there (CPU, CUDA, DTensor shards: DCP copies
    only what this rank writes to the host); an XLA tensor sharded on the mesh as this host's
    shards (never whole: on several hosts no host holds it all), a replicated one copied to the
    CPU."""
    if isinstance(t, DTensor) or t.device.type in ("cpu", "cuda"):
        return t.detach()
    if xla_shards.is_sharded(t):
        return xla_shards.host_shards(t)
    return t.detach().cpu()


def optimizer_tree(model: torch.nn.Module, optimizer) -> dict:
    """{name: {"state": {fqn: {key: tensor}},
    "param_groups": [{hyperparameters, "params": [fqn]}]}}."""
    names, stacked = _names(model), stacked_layers(model)
    out = {}
    for key, opt in optimizer_parts(optimizer).items():
        state = {
            names[id(p)]: {
                k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()
            }
            for p, st in opt.state.items()
        }
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [n for p in g["params"] for n in _layer_names(names[id(p)], stacked)],
            }
            for g in opt.param_groups
        ]
        state = _unstacked(state, stacked)
        out[key] = {"state": state, "param_groups": groups}
    return out


def stacked_layers(model: torch.nn.Module) -> dict[str, int]:
    """{name: n_layer} of the weights `model` keeps stacked (model/gpt.py: STACKED), which a
    checkpoint holds under the per-layer names "blocks.{i}.<name>"."""
    prefix = STACKED + "."
    return {n: p.shape[0] for n, p in model.named_parameters() if n.startswith(prefix)}


def _layer_names(name: str, stacked: dict[str, int]) -> list[str]:
    if name not in stacked:
        return [name]
    rest = name[len(STACKED) + 1 :]
    return [f"blocks.{i}.{rest}" for i in range(stacked[name])]


def _stack_of(name: str, stacked: dict[str, int]) -> tuple[str, int] | None:
    """(the stacked name, layer) of a per-layer name "blocks.{i}.<name>" kept stacked, else None."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit():
        key = f"{STACKED}.{parts[2]}"
        if key in stacked:
            return key, int(parts[1])
    return None


def _layer(v: Any, i: int, view: bool = False) -> Any:
    """Layer i of a stacked value (a 0-dim tensor, AdamW's step count, is every layer's; a dict,
    one parameter's optimizer state, by key); view: a view into `v` (a load target)."""
    if isinstance(v, dict):
        return {k: _layer(x, i, view) for k, x in v.items()}
    if isinstance(v, xla_shards.HostShards):
        return xla_shards.layer(v, i)
    if isinstance(v, torch.Tensor):
        if v.dim() == 0:
            return v if view else v.clone()
        return v[i] if view else v[i].clone()
    return v


def _unstacked(tree: dict, stacked: dict[str, int]) -> dict:
    """{name: value} with each stacked entry as its per-layer entries (copies)."""
    out = {}
    for name, v in tree.items():
        if name in stacked:
            out.update({n: _layer(v, i) for i, n in enumerate(_layer_names(name, stacked))})
        else:
            out[name] = v
    return out


def _targets(saved: dict, current: dict, stacks: dict, part: tuple) -> dict:
    """Load targets of the saved {name: leaf}: where the model keeps a per-layer name's weight
    stacked (current: {name: tensor} holds the stack), a view of layer i of the stack's target,
    made once and kept in stacks[(part, stacked name)]; else _target."""
    stacked = {n: t.shape[0] for n, t in current.items() if n.startswith(STACKED + ".")}
    out = {}
    for name, leaf in saved.items():
        where = _stack_of(name, stacked)
        if where is None or not dcp_io.is_tensor_leaf(leaf):
            out[name] = _target(leaf, current.get(name)) if dcp_io.is_tensor_leaf(leaf) else leaf
            continue
        key, i = where
        like = current[key]
        if leaf[dcp_io.TENSOR] != list(like.shape[1:]):  # a scalar (AdamW's step count)
            out[name] = _target(leaf, None)
            continue
        if (part, key) not in stacks:
            stacks[(part, key)] = _target({**leaf, dcp_io.TENSOR: list(like.shape)}, like)
        out[name] = _layer(stacks[(part, key)], i, view=True)
    return out


def _restacked(loaded: dict, stacks: dict, part: tuple) -> dict:
    """Loaded {name: value} with the per-layer entries of stacked weights replaced by their
    stacks' targets (filled through the per-layer views)."""
    out = {k: v for k, v in loaded.items() if _stack_of(k, {n: 0 for p, n in stacks}) is None}
    out.update({name: t for (p, name), t in stacks.items() if p == part})
    return out


def _restacked_optimizer(saved: dict, loaded: dict, stacks: dict, key: str) -> tuple[dict, dict]:
    """A saved optimizer part (per-layer names) and its loaded state as the stacked model has
    them: one entry per stack, its tensors the stacks' targets, a scalar layer 0's."""
    stacked = {name: 0 for _, name in stacks}
    state, got = {}, {}
    for fqn, st in saved["state"].items():
        where = _stack_of(fqn, stacked)
        if where is None:
            state[fqn], got[fqn] = st, loaded[fqn]
        elif where[1] == 0:
            name = where[0]
            state[name] = st
            got[name] = {k: stacks.get(((key, k), name), loaded[fqn].get(k)) for k in st}
    groups = [
        {**g, "params": list(dict.fromkeys(_fold(n, stacked) for n in g["params"]))}
        for g in saved["param_groups"]
    ]
    return {**saved, "state": state, "param_groups": groups}, got


def _fold(name: str, stacked: dict) -> str:
    where = _stack_of(name, stacked)
    return name if where is None else where[0]


@dataclass
class TrainingParts:
    """What a checkpoint saves and restores besides the counters: the plain model (no
    torch.compile wrapper), its optimizer and the training loader."""

    model: torch.nn.Module
    optimizer: Any
    loader: Any


@dataclass(frozen=True)
class StepRecord:
    """What a checkpoint records about where training stands and how it ran."""

    step: int
    tokens: int
    log_window: dict  # the unfinished loss window (metrics.LossWindow.state())
    world_size: int
    batch_tokens: int
    tokenizer_sha: str  # eval and sample refuse a checkpoint of a retrained tokenizer
    parallel: str  # the layout, as Layout.describe() says it


def save_training(
    cfg,
    control,
    parts: TrainingParts,
    record: StepRecord,
    writer: async_save.BackgroundWriter | None = None,
) -> async_save.PendingSave:
    """Every rank: write everything a resumed run needs to continue exactly. writer (this rank's
    BackgroundWriter, train.async_save): copy the state now and write it in the writer's process
    while training goes on; wait() on the result."""
    stacked = stacked_layers(parts.model)
    model_tree = {k: _local(v) for k, v in parts.model.state_dict().items()}
    state = {
        "model": _unstacked(model_tree, stacked),
        "optimizer": optimizer_tree(parts.model, parts.optimizer),
        "rng": {f"rank_{control.rank}": checkpoint.rng_state()},
        "step": record.step,
        "tokens": record.tokens,
        "loader": parts.loader.state_dict(),
        "config": to_dict(cfg),
        "codex_version": codex.__version__,
        "world_size": record.world_size,
        "batch_tokens": record.batch_tokens,
        "tokenizer_sha256": record.tokenizer_sha,
        "log_window": record.log_window,
        "parallel": record.parallel,
    }
    keep = dict(keep_last=cfg.train.keep_last, keep_every=cfg.train.keep_every)
    if writer is not None:
        return async_save.save_in_background(cfg.run, state, writer, **keep)
    return async_save.PendingSave.done(checkpoint.save(cfg.run, state, control=control, **keep))


def _target(leaf: dict, like: torch.Tensor | None) -> torch.Tensor | xla_shards.HostShards:
    """Where DCP loads one saved tensor: into a DTensor shaped like its parameter (this rank's
    slice only), this host's pieces of an XLA tensor sharded like it, else a full CPU tensor."""
    same_shape = like is not None and list(like.shape) == leaf[dcp_io.TENSOR]
    dtype = getattr(torch, leaf["dtype"])
    if isinstance(like, DTensor) and same_shape:
        return torch.zeros_like(like, dtype=dtype)
    if like is not None and same_shape and xla_shards.is_sharded(like):
        return xla_shards.host_targets(like, dtype)
    return dcp_io.empty_like_leaf(leaf)


def _on_device(loaded: dict) -> dict:
    """Loaded optimizer state {fqn: {key: value}} with every HostShards made an XLA tensor sharded
    like its parameter: the state arrives on the chips sharded, never whole."""
    return {
        fqn: {
            k: xla_shards.to_device(v) if isinstance(v, xla_shards.HostShards) else v
            for k, v in st.items()
        }
        for fqn, st in loaded.items()
    }


def _load_model(model: torch.nn.Module, loaded: dict) -> None:
    """Put loaded weights into `model`: XLA-sharded ones swapped in shard by shard
    (xla_shards.place), the rest through load_state_dict."""
    params = dict(model.named_parameters(remove_duplicate=False))
    placed = {k for k, v in loaded.items() if isinstance(v, xla_shards.HostShards)}
    for k in placed:
        xla_shards.place(params[k], loaded[k])
    rest = {k: v for k, v in loaded.items() if k not in placed}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    if set(missing) != placed or unexpected:
        raise RuntimeError(
            f"the checkpoint's model state does not match the model: missing "
            f"{sorted(set(missing) - placed)}, unexpected {sorted(unexpected)}"
        )


def _optimizer_targets(model: torch.nn.Module, saved: dict, stacks: dict) -> dict:
    params = dict(model.named_parameters())
    out = {}
    for key, part in saved.items():
        keys = {k for st in part["state"].values() for k in st}
        by_key = {  # {state key: {fqn: target}}: a stacked weight's per-layer views share a stack
            k: _targets(
                {fqn: st[k] for fqn, st in part["state"].items() if k in st},
                params,
                stacks,
                (key, k),
            )
            for k in keys
        }
        out[key] = {
            "state": {fqn: {k: by_key[k][fqn] for k in st} for fqn, st in part["state"].items()}
        }
    return out


def _torch_format(
    model: torch.nn.Module, opt: torch.optim.Optimizer, saved: dict, loaded: dict
) -> dict:
    """A saved (fqn-keyed) optimizer part as torch's state_dict for `opt` (positional ids)."""
    names = _names(model)
    ids: dict[str, int] = {}
    groups: list[dict] = []
    for cur, old in zip(opt.param_groups, saved["param_groups"], strict=False):
        fqns = [names[id(p)] for p in cur["params"]]
        if sorted(fqns) != sorted(old["params"]) or len(opt.param_groups) != len(
            saved["param_groups"]
        ):
            raise ConfigError(
                "the checkpoint's optimizer parameter groups differ from this run's: resume with "
                "the same model and train.optimizer, or use a new --run"
            )
        for f in fqns:
            ids[f] = len(ids)
        groups.append({**old, "params": [ids[f] for f in fqns]})
    state = {
        ids[fqn]: {k: loaded[fqn][k] if dcp_io.is_tensor_leaf(v) else v for k, v in st.items()}
        for fqn, st in saved["state"].items()
    }
    return {"state": state, "param_groups": groups}


def _check_same_model(cfg, saved_config: dict) -> None:
    saved_model = saved_config.get("model", {})
    for k, v in to_dict(cfg.model).items():
        # the preset is a name, not the model
        if k != "preset" and k in saved_model and saved_model[k] != v:
            raise ConfigError(
                f"model.{k}={v!r} differs from the checkpoint's {saved_model[k]!r} "
                f"({rundir.checkpoints_dir(cfg.run)}); "
                "resume with the same model or use a new --run"
            )


def _check_same_data(cfg, tree: dict) -> None:
    """The data run a checkpoint was trained on (train.data_run; "" = its own run) is the one this
    run reads: another one's windows would be other text at the loader's saved position."""
    saved = tree["config"].get("train", {}).get("data_run", "") or cfg.run
    data = rundir.data_run(cfg)
    if not rundir.same_dir(saved, data):
        raise ConfigError(
            f"{rundir.checkpoints_dir(cfg.run)}: step {tree['step']} was trained on the data of "
            f"{saved}, this command reads {data} (train.data_run); resume with --data {saved}, "
            "or train on other data in a new --run"
        )


def _check_same_tokenizer(cfg, tree: dict, tokenizer_sha: str) -> None:
    """First: a retrained tokenizer also changes the vocabulary and the shards, so every later
    check (the model's vocab_size, the loader's window count) would fail first and name a
    consequence instead of the cause."""
    saved = str(tree.get("tokenizer_sha256", ""))
    if saved and tokenizer_sha and saved != tokenizer_sha:
        raise ValueError(
            f"{rundir.checkpoints_dir(cfg.run)}: step {tree['step']} was trained with another "
            f"tokenizer ({saved[:12]}) than {rundir.tokenizer_dir(rundir.data_run(cfg))} "
            f"({tokenizer_sha[:12]}): its token ids mean other text; use a new --run"
        )


def restore_training(
    cfg, control, step: int, parts: TrainingParts, tokenizer_sha: str
) -> StepRecord:
    """Every rank: load checkpoint `step` into the model, optimizer, loader and this rank's RNGs,
    whatever layout and world size wrote it; returns what the checkpoint records (the step, the
    tokens, the unfinished log window, and the batch and layout it was trained with). Refused
    when it was trained with another model or tokenizer (`tokenizer_sha`: the run's)."""
    model, optimizer, loader = parts.model, parts.optimizer, parts.loader
    folder = checkpoint.step_dir(cfg.run, step)
    tree = checkpoint.read_skeleton(folder)
    _check_same_data(cfg, tree)
    _check_same_tokenizer(cfg, tree, tokenizer_sha)
    _check_same_model(cfg, tree["config"])
    opt_parts = optimizer_parts(optimizer)
    if set(opt_parts) != set(tree["optimizer"]):

        def name(keys):
            return "muon" if "muon" in keys else "adamw"

        raise ConfigError(
            "the checkpoint's optimizer state is for "
            f"train.optimizer={name(tree['optimizer'])}, this run uses {name(opt_parts)}: "
            "resume with the same optimizer or use a new --run"
        )
    stacks: dict = {}  # the targets of weights kept stacked, filled through per-layer views
    targets = {
        "model": _targets(tree["model"], model.state_dict(), stacks, ("model",)),
        "optimizer": _optimizer_targets(model, tree["optimizer"], stacks),
    }
    rng_key = f"rank_{control.rank}"
    if rng_key in tree["rng"]:
        targets["rng"] = {rng_key: dcp_io.targets_from_skeleton(tree["rng"][rng_key])}
    else:
        log.warning(
            "%s was written by %d ranks: rank %d keeps its fresh RNG state",
            folder,
            tree["world_size"],
            control.rank,
        )
    dcp_io.read_tensors(folder, targets, control)
    _load_model(model, _restacked(targets["model"], stacks, ("model",)))
    saved = {}
    for key, opt in opt_parts.items():
        part, got = _restacked_optimizer(
            tree["optimizer"][key], targets["optimizer"][key]["state"], stacks, key
        )
        saved[key] = _torch_format(model, opt, part, _on_device(got))
    load_optimizer_state(optimizer, saved if isinstance(optimizer, Optimizers) else saved["adamw"])
    loader.load_state_dict(tree["loader"])
    if "rng" in targets:
        checkpoint.set_rng_state(targets["rng"][rng_key])
    step = int(tree["step"])
    return StepRecord(
        step=step,
        tokens=int(tree["tokens"]),
        log_window=tree.get("log_window") or {"loss_sum": 0.0, "since": step},
        world_size=int(tree.get("world_size", 0)),
        batch_tokens=int(tree.get("batch_tokens", 0)),
        tokenizer_sha=str(tree.get("tokenizer_sha256", "")),
        parallel=str(tree.get("parallel", "")),
    )
