"""The run-directory contract: every stage reads and writes under one RUN (local path or gs://).

    RUN/clean/        cleaned parquet parts, stats.json, per-unit markers      (codex data clean)
    RUN/tokenizer/    tokenizer.json, token_bytes.npy, tokenizer_meta.json     (codex data tokenize)
    RUN/shards/       train_*.npy, val_*.npy, manifest.json (written last)     (codex data shard)
    RUN/checkpoints/  step_XXXXXXXX/ checkpoints                               (codex train)
    RUN/eval/         step_N.json, loss.png                                    (codex eval)
    RUN/metrics.jsonl training and validation metrics, one JSON object a line (codex train)

So stages chain with nothing more than `--run DIR` (a data stage's rules: pipeline/stage.py).
A training may read another run's tokenizer/ and shards/ (train.data_run, `codex train --data`).
ARCHITECTURE.md, "Run directory", lists every file, the writer's lease (codex/core/runlock.py) too.
"""

from __future__ import annotations

import os

from codex.core import fsio


def clean_dir(run: str) -> str:
    return fsio.join(run, "clean")


TOKENIZER_META = "tokenizer_meta.json"  # the tokenizer stage's contract, written last


def tokenizer_dir(run: str) -> str:
    return fsio.join(run, "tokenizer")


def shards_dir(run: str) -> str:
    return fsio.join(run, "shards")


def checkpoints_dir(run: str) -> str:
    return fsio.join(run, "checkpoints")


def eval_dir(run: str) -> str:
    return fsio.join(run, "eval")


def metrics_path(run: str) -> str:
    return fsio.join(run, "metrics.jsonl")


def data_run(cfg) -> str:
    """The run whose tokenizer/ and shards/ a training reads: train.data_run, else its own run."""
    return cfg.train.data_run or cfg.run


def same_dir(a: str, b: str) -> bool:
    """Whether two run paths name one folder as written (runs/x, ./runs/x/ and runs//x do)."""
    if fsio.is_remote(a) or fsio.is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.normpath(a) == os.path.normpath(b)
