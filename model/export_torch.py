"""A checkpoint as one plain PyTorch file (`codex export --format torch --out model.pt`): the
weights and the model config, nothing else, loadable with torch.load(weights_only=True) (no pickled
code):

    saved = torch.load("model.pt", weights_only=True)
    model = GPT(ModelConfig(**saved["model_config"]))
    model.load_state_dict(saved["model"])

docs/export.md, "One torch file", has the file's keys and what its state dict holds.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch

from codex.core import fsio
from codex.core.config import ConfigError


def export_torch(weights: dict, run_cfg, info: dict, out: str) -> dict:
    """Write a checkpoint's weights (as train/checkpoint/read.py's read_checkpoint returns them,
    with its Config and info) as one torch.save file at `out` (local or gs://, written atomically:
    an interrupted export leaves no partial file). Returns {"path", "step", ...}."""
    check_export_target(out)
    saved = {
        "model": {
            k: v.detach().to("cpu", torch.float32).contiguous()
            if v.is_floating_point()
            else v.cpu()
            for k, v in weights.items()
        },
        "model_config": dataclasses.asdict(run_cfg.model),
        "step": info["step"],
        "tokenizer_sha256": info["tokenizer_sha256"],
    }
    _retie(saved["model"], run_cfg.model)
    _save(saved, out)
    return {
        "path": out,
        "step": info["step"],
        "train_tokens": info["train_tokens"],
        "checkpoint": info["path"],
        "vocab_size": run_cfg.model.vocab_size,
        "bytes": fsio.size(out),
    }


def check_export_target(out: str) -> None:
    """Refuse an --out that exists (exit 2), before a checkpoint is read."""
    if fsio.exists(out):
        raise ConfigError(f"--out {out} already exists; remove it or choose another file")


def _save(obj, out: str) -> None:
    if not fsio.is_remote(out):
        with fsio.atomic_open(out, "wb") as f:
            torch.save(obj, f)
        return
    # torch.save wants a seekable file: serialise locally, then upload (temp object + move)
    fd, tmp = tempfile.mkstemp(suffix=".pt")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        fsio.upload(tmp, out)
    finally:
        os.unlink(tmp)


def _retie(state: dict, m) -> None:
    """Keep a tied embedding and head one tensor in the file (the copies above made two)."""
    if m.tie_embeddings and "wte.weight" in state and "lm_head.weight" in state:
        state["lm_head.weight"] = state["wte.weight"]
