"""Tiny run directories for the training tests: a tokenizer meta + token bytes and npy shards that
follow the contracts in ARCHITECTURE.md (no real tokenizer needed by the training loop)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

VOCAB = 300

# A model that trains in milliseconds a step on one core.
TINY_MODEL = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_kv_head=1",
    "model.n_embd=32",
    "model.max_seq_len=32",
]


def make_run(root: Path, train_tokens: int = 20_000, val_tokens: int = 2_000, seed: int = 0) -> str:
    """RUN/tokenizer/{tokenizer_meta.json, token_bytes.npy} + RUN/shards/{train,val}_*.npy +
    manifest."""
    rng = np.random.default_rng(seed)
    run = Path(root)
    tok = run / "tokenizer"
    shards = run / "shards"
    tok.mkdir(parents=True, exist_ok=True)
    shards.mkdir(parents=True, exist_ok=True)
    (tok / "tokenizer_meta.json").write_text(
        json.dumps(
            {"vocab_size": VOCAB, "special_ids": {"bos": 0, "eos": 1, "pad": 2}, "sha256": "0" * 64}
        )
    )
    token_bytes = np.concatenate([[0, 0, 0], rng.integers(1, 5, VOCAB - 3)]).astype(np.int32)
    np.save(tok / "token_bytes.npy", token_bytes)

    def doc_stream(n):
        # Learnable text: short "documents" of counting sequences with a random start and stride.
        out = []
        while sum(map(len, out)) < n:
            start, stride, length = rng.integers(3, VOCAB), rng.integers(1, 4), rng.integers(10, 60)
            out.append(
                np.concatenate([[0], 3 + (start + stride * np.arange(length)) % (VOCAB - 3)])
            )
        return np.concatenate(out)[:n].astype(np.uint16)

    entries = []
    for split, total, n_shards in (("train", train_tokens, 2), ("val", val_tokens, 1)):
        per = total // n_shards
        for i in range(n_shards):
            name = f"{split}_{i:05d}.npy"
            np.save(shards / name, doc_stream(per))
            entries.append(
                {"split": split, "path": name, "format": "npy", "tokens": per, "documents": 0}
            )
    manifest = {
        "format_version": 1,
        "tokenizer": {"sha256": "0" * 64, "vocab_size": VOCAB},
        "special_ids": {"bos": 0, "eos": 1, "pad": 2},
        "dtype": "uint16",
        "append_eos": False,
        "val_fraction": 0.1,
        "shards": entries,
        "totals": {},
    }
    (shards / "manifest.json").write_text(json.dumps(manifest))
    return str(run)


def base_overrides(**train) -> list[str]:
    """Overrides for a tiny CPU run; keyword args set train.* keys."""
    t = {
        "hardware": "cpu",
        "device_batch": 4,
        "seq_len": 16,
        "max_steps": 5,
        "warmup_steps": 2,
        "lr": 1e-2,
        "log_every": 1,
        "eval_every": 0,
        "save_every": 0,
        "wandb": "off",
        "compile": False,
    }
    t.update(train)
    return TINY_MODEL + [f"train.{k}={v}" for k, v in t.items()]


def child_env() -> dict:
    """Environment for subprocess runs: one thread (bitwise-comparable with the test process); a
    fatal signal (a test's SIGABRT to a hung child) prints every thread's Python stack."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONPATH": root,
            "WANDB_MODE": "offline",
            "PYTHONFAULTHANDLER": "1",
        }
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def optimizer_tensors(saved: dict) -> dict[tuple, torch.Tensor]:
    """Every tensor of a checkpoint's optimizer state, keyed (optimizer, param id, name): one
    AdamW's state, or Muon's and AdamW's (train.optimizer=muon)."""
    parts = [("adamw", saved)] if "state" in saved else list(saved.items())
    return {
        (which, pid, name): t
        for which, part in parts
        for pid, st in part["state"].items()
        for name, t in st.items()
        if isinstance(t, torch.Tensor)
    }


def plan_without_run(cfg, preset, world: int):
    """make_plan without the run's files (the vocab: model.vocab_size, else
    data.tokenizer.vocab_size), as `codex train --help` plans."""
    from codex.train.plan.plan import make_plan

    vocab = cfg.model.vocab_size or cfg.data.tokenizer.vocab_size
    return make_plan(cfg, preset, world, vocab=vocab)[1]
