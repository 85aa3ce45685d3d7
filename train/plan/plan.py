"""The run's plan: what training derives once from the config, the hardware preset and the run's
files (tokenizer, shard manifest), before the first step. One pass, each number decided once:
the vocabulary, the learning rate, the batch (train/plan/batch.py, which asks memory.py), the
layout (layout.py), the steps. `codex train --help` formats the same Plan (report.py).

    cfg, plan, token_bytes = make_plan(cfg, preset, world_size)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from codex.core import fsio, rundir
from codex.core.config import Config, ConfigError, load_yaml
from codex.core.config.model import mlp_hidden
from codex.core.config.train import DEFAULT_LR, TrainConfig
from codex.train.plan.batch import choose_batch
from codex.train.plan.layout import Layout, layout_for
from codex.train.plan.memory import MemoryPlan
from codex.train.plan.presets import HardwarePreset
from codex.train.plan.step_time import StepTime

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Plan:
    vocab: int
    device_batch: int  # B: sequences per device per micro-batch
    seq_len: int  # T
    accum: int  # micro-batches per optimizer step
    batch_tokens: int  # tokens per optimizer step = B * T * world_size * accum
    total_steps: int
    world_size: int
    tokenizer_sha: str  # recorded in checkpoints: eval and sample refuse a retrained tokenizer
    memory: MemoryPlan  # bytes per device (train/plan/memory.py), logged at start
    layout: Layout  # replicate or fsdp (train.parallel, resolved; train/plan/layout.py)
    preset: HardwarePreset
    device_batch_given: bool = True  # False: the memory plan's default
    seq_len_given: bool = True  # False: the preset's for the model
    time: StepTime | None = None  # the modelled step (TPU presets: train/plan/step_time.py)


def planned_vocab(cfg: Config) -> int:
    """The vocab a plan counts without the run's files: model.vocab_size, else the one the
    tokenizer will be trained to (data.tokenizer.vocab_size)."""
    return cfg.model.vocab_size or cfg.data.tokenizer.vocab_size


def tokenizer_vocab(cfg: Config) -> int | None:
    """The vocab of the data run's finished tokenizer (tokenizer/tokenizer_meta.json of
    rundir.data_run: the number training reads), read without torch for `codex train --help` and
    --compile-only. None when there is none yet, or the run is on an object store (--help makes
    no request) or its meta is unreadable (training says what is wrong). A model.vocab_size that
    disagrees is the ConfigError training raises."""
    data = rundir.data_run(cfg)
    if fsio.is_remote(data):
        return None
    path = fsio.join(rundir.tokenizer_dir(data), rundir.TOKENIZER_META)
    try:
        vocab = int(fsio.read_json(path)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    _check_model_vocab(cfg, vocab)
    return vocab


def _check_model_vocab(cfg: Config, vocab: int) -> None:
    if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} but the run's tokenizer has {vocab} tokens; "
            "leave model.vocab_size at 0 (taken from the tokenizer)"
        )


def learning_rate(t: TrainConfig) -> float:
    """train.lr, or the optimizer's default when it is 0."""
    return t.lr or DEFAULT_LR[t.optimizer]


def total_steps(t: TrainConfig, batch_tokens: int) -> int:
    """Optimizer steps: train.max_tokens over batch_tokens, rounded up, when a token budget is set,
    else train.max_steps."""
    steps = math.ceil(t.max_tokens / batch_tokens) if t.max_tokens > 0 else t.max_steps
    if steps <= 0:
        raise ConfigError("train.max_steps (or train.max_tokens) must be positive")
    return steps


def make_plan(
    cfg: Config, preset: HardwarePreset, world_size: int, vocab: int | None = None
) -> tuple[Config, Plan, torch.Tensor | None]:
    """(the resolved config, the Plan, token_bytes). The resolved config carries the tokenizer's
    vocab size, the MLP width (so a later change of the derivation cannot change a saved model's
    shape) and the learning rate: it is what checkpoints record and what eval rebuilds the model
    from. vocab: given, no run file is read (`--help`, a compile before any data exists)."""
    if vocab is None:
        vocab, token_bytes, tokenizer_sha = _read_vocab(cfg)
    else:
        token_bytes, tokenizer_sha = None, ""
    cfg = replace(
        cfg,
        model=replace(cfg.model, vocab_size=vocab, mlp_hidden=mlp_hidden(cfg.model)),
        train=replace(cfg.train, lr=learning_rate(cfg.train)),
    )
    b = choose_batch(cfg, preset, world_size)
    # train.remat=auto resolved (the search's choice on TPU, else none): what the run applies
    cfg = replace(cfg, train=replace(cfg.train, remat=b.setting.remat))
    layout = layout_for(b.setting.layout, b.setting.fsdp_size, world_size)
    # fsdp: keep the gathered weights from forward to backward (ZeRO-2) where the plan fits them
    layout = replace(layout, reshard_after_forward=b.memory.reshard_after_forward)
    plan = Plan(
        vocab=vocab,
        device_batch=b.device_batch,
        seq_len=b.seq_len,
        accum=b.accum,
        batch_tokens=b.batch_tokens,
        total_steps=total_steps(cfg.train, b.batch_tokens),
        world_size=world_size,
        tokenizer_sha=tokenizer_sha,
        memory=b.memory,
        layout=layout,
        preset=preset,
        device_batch_given=b.device_batch_given,
        seq_len_given=b.seq_len_given,
        time=b.time,
    )
    return cfg, plan, token_bytes


# --- run inputs -------------------------------------------------------------------------------


def _recorded_data_run(run: str) -> str:
    """The train.data_run the run's last training started with (RUN/checkpoints/config.yaml);
    "" when none."""
    path = fsio.join(rundir.checkpoints_dir(run), "config.yaml")
    if not fsio.exists(path):
        return ""
    return str((load_yaml(path).get("train") or {}).get("data_run") or "")


def _read_vocab(cfg: Config) -> tuple[int, torch.Tensor | None, str]:
    """Vocab size from the tokenizer meta of the data run (rundir.data_run: train.data_run, else
    the run), checked against its shard manifest, token_bytes for bits per byte (None when absent;
    validation then says what is missing), and the tokenizer's sha256 (recorded in checkpoints, so
    eval and sample can refuse a retrained tokenizer)."""
    # imported here: `codex train --help` plans without torch or the run's files
    import numpy as np
    import torch

    from codex.pipeline.tokenizer.tokenizer import TOKEN_BYTES_FILE, load_meta, load_token_bytes
    from codex.train.data.token_shards import load_manifest

    data = rundir.data_run(cfg)
    tok_dir, shards_dir = rundir.tokenizer_dir(data), rundir.shards_dir(data)
    try:
        if not rundir.same_dir(data, cfg.run) and not fsio.isdir(data):
            raise FileNotFoundError("no such run directory")
        meta = load_meta(tok_dir)
        manifest = load_manifest(shards_dir)
    except FileNotFoundError as e:  # a usage mistake (exit 2), naming the flag that chose the path
        if not rundir.same_dir(data, cfg.run):
            raise FileNotFoundError(f"--data {data} (train.data_run): {e}") from None
        recorded = _recorded_data_run(cfg.run)
        if not recorded:
            raise
        raise FileNotFoundError(
            f"{e}; {rundir.checkpoints_dir(cfg.run)} trained on the data of {recorded}: "
            f"resume with --data {recorded}"
        ) from None
    vocab = int(meta["vocab_size"])
    m_vocab = int(manifest.get("tokenizer", {}).get("vocab_size", vocab))
    if m_vocab != vocab:  # the run's data do not match: bad data (exit 1), as a sha256 mismatch
        raise ValueError(
            f"{fsio.join(shards_dir, 'manifest.json')}: shards were made with "
            f"vocab_size {m_vocab}, but the tokenizer in {tok_dir} has {vocab}; "
            "re-run `codex data shard`"
        )
    m_sha = manifest.get("tokenizer", {}).get("sha256")
    if m_sha and meta.get("sha256") and m_sha != meta["sha256"]:
        raise ValueError(
            f"{fsio.join(shards_dir, 'manifest.json')}: shards were made with "
            f"another tokenizer ({m_sha[:12]}) than {tok_dir} ({meta['sha256'][:12]}); "
            "re-run `codex data shard`"
        )
    _check_model_vocab(cfg, vocab)
    if cfg.train.data.mixture:
        from codex.train.data.mixture import check_sources

        check_sources(cfg.train.data, manifest, shards_dir)
    token_bytes = None
    if fsio.exists(fsio.join(tok_dir, TOKEN_BYTES_FILE)):
        token_bytes = torch.from_numpy(load_token_bytes(tok_dir).astype(np.int64))
    return vocab, token_bytes, str(meta.get("sha256", ""))
