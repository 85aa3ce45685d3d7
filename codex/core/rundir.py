"""The run-directory contract: every stage reads and writes under one RUN (local path or gs://).

    RUN/clean/        cleaned parquet parts, stats.json, per-unit markers      (codex data clean)
    RUN/tokenizer/    tokenizer.json, token_bytes.npy, tokenizer_meta.json     (codex data tokenize)
    RUN/shards/       train_*.npy, val_*.npy, manifest.json (written last)     (codex data shard)
    RUN/checkpoints/  step_XXXXXXXX/ checkpoints                               (codex train)
    RUN/eval/         step_N.json, loss.png                                    (codex eval)
    RUN/metrics.jsonl training and validation metrics, one JSON object a line (codex train)

So stages chain with nothing more than `--run DIR` (a data stage's rules: pipeline/stage.py).
ARCHITECTURE.md, "Run directory", lists every file, the writer's lease (codex/core/runlock.py) too.
"""

from __future__ import annotations

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
