"""`codex eval`: loss / perplexity / bits per byte of a checkpoint, written to RUN/eval/step_N.json.

checkpoint (train/checkpoint/read.py) -> the val split of the run (or of the data run it trained
on: train.data_run), or --data text (eval/data.py)
-> evaluate() (eval/evaluate.py, the same function as training's validation)
-> RUN/eval/step_N.json (step_N.data-<hash>.json for --data), a table, RUN/eval/loss.png
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time

import torch

from codex.core import fsio, rundir
from codex.core.progress import Progress, setup_logging
from codex.eval.data import tokenize_to_shard
from codex.eval.evaluate import evaluate
from codex.pipeline.tokenizer.tokenizer import load_meta, load_token_bytes
from codex.train.checkpoint.read import load_model
from codex.train.data.loader import val_batches
from codex.train.data.token_shards import load_split
from codex.train.distributed.backend import loader_layout, unwrap
from codex.train.launch import open_backend
from codex.train.plan.batch import default_seq_len, device_defaults
from codex.train.plan.presets import get_preset

log = logging.getLogger("codex.eval")


def run_eval(cfg) -> dict:
    """`codex eval`: loss / perplexity / bits per byte of checkpoint cfg.eval.checkpoint on the
    pinned val split, or on other text (cfg.eval.data, cleaned and tokenized on the fly with the
    run's tokenizer), at most cfg.eval.max_tokens tokens (0 = all).

    Runs on cfg.train.hardware (CPU, CUDA under torchrun, XLA); every rank returns the same
    global numbers. Rank 0 writes RUN/eval/step_N.json (or step_N.data-<hash>.json for --data)
    and prints a small table. Returns the record written.
    """
    setup_logging()
    with open_backend(cfg) as backend:
        return _run_eval(cfg, backend)


def _run_eval(cfg, backend) -> dict:
    data_paths, max_tokens = list(cfg.eval.data), cfg.eval.max_tokens
    model, run_cfg, info = load_model(cfg, cfg.eval.checkpoint)
    tok_dir = rundir.tokenizer_dir(info["data_run"])
    token_bytes = torch.from_numpy(load_token_bytes(tok_dir).astype("int64"))
    if len(token_bytes) != run_cfg.model.vocab_size:
        raise ValueError(
            f"{fsio.join(tok_dir, 'token_bytes.npy')}: {len(token_bytes)} tokens, "
            "but the checkpoint "
            f"{info['path']} was trained with model.vocab_size={run_cfg.model.vocab_size}"
        )
    T, B = trained_seq_len(run_cfg), eval_batch_size(cfg, run_cfg)
    # The same layout as training's validation (train/loop.py): one loader per data-loading
    # process (under XLA SPMD one per host, feeding all its chips); with several of them, and on
    # XLA, the same number of full batches on every rank with a row mask (val_batches).
    rank, world, rows = loader_layout(backend, B)
    with_mask = backend.fixed_shapes
    model = unwrap(backend.prepare_model(model))

    if data_paths:
        shards_dir, tmp, documents = tokenize_to_shard(
            cfg, run_cfg, info["data_run"], data_paths, max_tokens, T, backend
        )
    else:
        shards_dir, tmp, documents = _val_shards(info["data_run"], tok_dir), None, None
    try:
        windows = load_split(shards_dir, "val", T).windows
        if max_tokens > 0:
            windows = min(windows, max(1, max_tokens // T))
        steps = -(-windows // (rows * world))
        batches = val_batches(
            shards_dir,
            seq_len=T,
            batch_size=rows,
            rank=rank,
            world_size=world,
            max_tokens=max_tokens,
            with_mask=with_mask,
        )
        with Progress("eval", total=steps, unit="batches", enabled=backend.is_main) as progress:
            result = evaluate(model, batches, token_bytes, backend=backend, progress=progress)
    finally:
        if tmp is not None:
            tmp.cleanup()
    record = _eval_record(cfg, backend, info, result, T=T, B=B, documents=documents)
    if backend.is_main:
        _write_record(cfg, record, info["step"])
    return record


def _val_shards(data_run: str, tok_dir: str) -> str:
    """The data run's shards/ (train.data_run, else RUN's), checked to be made with its tokenizer
    (when the manifest says which)."""
    shards_dir = rundir.shards_dir(data_run)
    manifest_path = fsio.join(shards_dir, "manifest.json")
    manifest = fsio.read_json(manifest_path) if fsio.exists(manifest_path) else None
    meta = load_meta(tok_dir)
    if manifest and manifest.get("tokenizer", {}).get("sha256") not in (None, meta.get("sha256")):
        raise ValueError(
            f"{manifest_path}: the shards were made with another tokenizer "
            f"({manifest['tokenizer']['sha256'][:12]}) than {tok_dir} "
            f"({meta.get('sha256', '')[:12]})"
        )
    return shards_dir


def _eval_record(cfg, backend, info: dict, result: dict, *, T: int, B: int, documents) -> dict:
    """7 parameters: one per part of the record it assembles; _run_eval, its one caller, has each at
    hand."""
    data_paths = list(cfg.eval.data)
    return {
        "step": info["step"],
        "tokens": result["tokens"],
        "bytes": result["bytes"],
        "loss": result["loss"],
        "perplexity": result["perplexity"],
        "bits_per_byte": result["bits_per_byte"],
        "split": None if data_paths else "val",
        "data": data_paths or None,
        "documents": documents,
        "max_tokens": int(cfg.eval.max_tokens),
        "seq_len": T,
        "device_batch": B,
        "checkpoint": info["path"],
        "train_tokens": info["train_tokens"],
        "world_size": backend.world_size,
        "backend": backend.device.type,  # cpu, cuda or xla
        "hardware": cfg.train.hardware,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config_fingerprint": info["config_fingerprint"],
    }


def _write_record(cfg, record: dict, step: int) -> None:
    """Rank 0: RUN/eval/step_N.json (a --data result never overwrites the val split's), the table,
    and the loss plot; adds their paths to `record`."""
    name = f"step_{step}.json"
    if cfg.eval.data:
        key = hashlib.sha256(json.dumps(sorted(cfg.eval.data)).encode()).hexdigest()[:8]
        name = f"step_{step}.data-{key}.json"
    out = fsio.join(rundir.eval_dir(cfg.run), name)
    fsio.makedirs(rundir.eval_dir(cfg.run))
    fsio.write_json(out, _json_safe(record))
    record["path"] = out
    print(format_table(record))
    record["plot"] = _plot_if_possible(cfg.run)


def _plot_if_possible(run: str) -> str | None:
    """RUN/eval/loss.png from the training metrics, when the run has them."""
    if not fsio.exists(rundir.metrics_path(run)):
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("loss plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    from codex.eval.plot import (
        plot_loss,  # imports matplotlib: an optional dependency, checked above
    )

    path = plot_loss(run)
    print(f"loss plot: {path}")
    return path


def _json_safe(record: dict) -> dict:
    # json.dumps writes NaN/Infinity, which is not JSON; strings keep the file parseable everywhere.
    return {
        k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
        for k, v in record.items()
    }


def format_table(r: dict) -> str:
    what = "val split" if r.get("split") else ", ".join(r["data"])
    rows = [
        ("checkpoint", f"step {r['step']} ({r['checkpoint']})"),
        (
            "data",
            what + (f" ({r['documents']} documents)" if r.get("documents") is not None else ""),
        ),
        ("tokens", f"{r['tokens']:,}"),
        ("bytes", f"{r['bytes']:,}"),
        ("loss (nats/token)", f"{r['loss']:.4f}"),
        ("perplexity", f"{r['perplexity']:.3f}"),
        ("bits per byte", f"{r['bits_per_byte']:.4f}"),
        (
            "backend",
            f"{r['backend']} x{r['world_size']} ({r['hardware']}), "
            f"batch {r['device_batch']} x {r['seq_len']}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def trained_seq_len(run_cfg) -> int:
    """The sequence length the checkpoint was trained with: evaluate at the same context length,
    or the numbers are not comparable with the training curve."""
    if run_cfg.train.seq_len > 0:
        return int(run_cfg.train.seq_len)
    return default_seq_len(get_preset(run_cfg.train.hardware), run_cfg.model)


def eval_batch_size(cfg, run_cfg) -> int:
    """eval.device_batch, else this hardware preset's training device batch for the model."""
    if cfg.eval.device_batch > 0:
        return int(cfg.eval.device_batch)
    return device_defaults(get_preset(cfg.train.hardware), run_cfg.model)[0]
