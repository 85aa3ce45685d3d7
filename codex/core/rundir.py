"""The run-directory contract: every stage reads and writes under one RUN (local path or gs://).

    RUN/clean/        cleaned parquet parts, stats.json, per-chunk markers     (codex data clean)
    RUN/tokenizer/    tokenizer.json, token_bytes.npy, tokenizer_meta.json     (codex data tokenize)
    RUN/shards/       train_*.npy, val_*.npy, manifest.json (written last)     (codex data shard)
    RUN/checkpoints/  step_XXXXXXXX/ checkpoints                               (codex train)
    RUN/eval/         step_N.json, loss.png                                    (codex eval)
    RUN/metrics.jsonl training and validation metrics, one JSON object a line (codex train)
    RUN/.codex-lock.json  the lease of the command writing RUN now (codex/core/runlock.py);
                      eval's is in RUN/eval/

so stages chain with nothing more than `--run DIR`. Each data stage saves the resolved config it
ran with as config.yaml inside its own folder and writes its completion marker last
(pipeline/stage.py).
"""

from __future__ import annotations

from codex.core import fsio


def clean_dir(run: str) -> str:
    return fsio.join(run, "clean")


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
