"""Reading a finished checkpoint in one process: the model's weights (full, plain CPU tensors),
the config it was trained with, and where it came from. The one place eval, sample, downstream
tasks and export read a checkpoint (training resumes through train/checkpoint/state.py).

A checkpoint whose tokenizer is not its data run's current one (train.data_run, else the run) is
refused: its ids would decode to the wrong text and bits per byte would count the wrong bytes.
"""

from __future__ import annotations

import hashlib
import json

from codex.core import fsio, rundir
from codex.core.config import from_dict
from codex.model.gpt import build_model
from codex.pipeline.tokenizer.tokenizer import load_meta
from codex.train.checkpoint import folders as ckpt


def read_checkpoint(cfg, checkpoint: str | int = "latest"):
    """(the model's state dict: full, plain CPU tensors; the checkpoint's Config; checkpoint info)
    for cfg.run: the one place eval, sample and export read a checkpoint."""
    state = ckpt.load(cfg.run, checkpoint, keys=("model",))  # not the optimizer state
    run_cfg = from_dict(state["config"])
    if run_cfg.model.vocab_size <= 0:
        raise ValueError(
            f"{ckpt.step_dir(cfg.run, int(state['step']))}: "
            "the checkpoint's config has no model.vocab_size"
        )
    data = _data_run(cfg, run_cfg, int(state["step"]))
    _check_tokenizer(cfg.run, data, state)
    info = {
        "step": int(state["step"]),
        "train_tokens": int(state.get("tokens", 0)),
        "path": ckpt.step_dir(cfg.run, int(state["step"])),
        "run": cfg.run,  # the run directory read now, not the one training saw
        "data_run": data,  # where its tokenizer and val split are read now
        "tokenizer_sha256": str(state.get("tokenizer_sha256", "")),
        # Which exact run configuration produced these weights (model + data + training settings).
        "config_fingerprint": hashlib.sha256(
            json.dumps(state["config"], sort_keys=True, default=str).encode()
        ).hexdigest()[:16],
    }
    return state["model"], run_cfg, info


def load_model(cfg, checkpoint: str | int = "latest"):
    """(model on the CPU in eval mode, the checkpoint's Config, checkpoint info) for cfg.run."""
    weights, run_cfg, info = read_checkpoint(cfg, checkpoint)
    model = build_model(run_cfg.model, seed=run_cfg.train.seed)
    model.load_state_dict(weights)
    model.eval()
    return model, run_cfg, info


def _data_run(cfg, run_cfg, step: int) -> str:
    """The run whose tokenizer and shards the checkpoint's are: this command's train.data_run
    (--set, for a data run since moved), else the one training recorded, else cfg.run."""
    data = cfg.train.data_run or run_cfg.train.data_run or cfg.run
    if not rundir.same_dir(data, cfg.run) and not fsio.isdir(data):
        raise FileNotFoundError(
            f"{data}: no such run directory, the data run {ckpt.step_dir(cfg.run, step)} was "
            "trained on (train.data_run); where it is now: --set train.data_run=PATH"
        )
    return data


def _check_tokenizer(run: str, data: str, state: dict) -> None:
    """Refuse a checkpoint whose tokenizer is not the data run's current one (retrained after
    training): its ids would decode to the wrong text and bits per byte would count the wrong
    bytes."""
    trained_with = state.get("tokenizer_sha256")
    tok_dir = rundir.tokenizer_dir(data)
    if not trained_with or not fsio.exists(fsio.join(tok_dir, "tokenizer_meta.json")):
        # Checkpoints from before this record, or a run without its tokenizer (later steps say so).
        return
    current = str(load_meta(tok_dir).get("sha256", ""))
    if current != trained_with:
        raise ValueError(
            f"{fsio.join(tok_dir, 'tokenizer.json')} (sha256 {current[:12]}) is not the tokenizer "
            f"{ckpt.step_dir(run, int(state['step']))} was trained with ({trained_with[:12]}): "
            "it was retrained after training; restore the original tokenizer or retrain the model"
        )
