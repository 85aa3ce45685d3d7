"""Training: `train(cfg, evaluate)` in loop.py, read top to bottom.

Files: loop.py (the loop), launch.py (the preset's backend), metrics.py (what a log line measures),
remat.py (activation checkpointing), compile_only.py (`codex train --compile-only`). Folders:
plan/, data/, optim/, distributed/ (CPU/CUDA), xla/ (TPU), checkpoint/. Parts import only those
before them in TRAIN_LAYERS (tests/fixtures/import_graph.py). train/ imports codex/core, model/
and pipeline/ (the tokenizer's artifact), never eval/. File by file: ARCHITECTURE.md.
"""
