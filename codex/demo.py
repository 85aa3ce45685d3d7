"""`codex demo`: clean -> tokenize -> shard -> train -> eval on a corpus every machine has.

The corpus is the Python standard library's own .py sources, located through sysconfig (no
download), minus site-packages (which holds whatever the user installed, so results would vary).
Every stage runs through the same function as its `codex` command, with configs/runs/demo.yaml.
"""

from __future__ import annotations

import logging
import os
import sysconfig
import time

from codex.config import CONFIGS_DIR, build_config

log = logging.getLogger("codex.demo")


def stdlib_inputs() -> list[str]:
    """Globs covering the stdlib's .py files, excluding site-packages."""
    stdlib = sysconfig.get_paths()["stdlib"]
    inputs = [os.path.join(stdlib, "*.py")]
    for name in sorted(os.listdir(stdlib)):
        path = os.path.join(stdlib, name)
        if os.path.isdir(path) and name not in ("site-packages", "__pycache__"):
            inputs.append(os.path.join(path, "**", "*.py"))
    return inputs


def run_demo(run: str, overrides=()) -> dict:
    from eval.evaluate import run_eval
    from pipeline.clean import run_clean
    from pipeline.shard import run_shard
    from pipeline.tokenizer import run_tokenizer
    from train.loop import train

    cfg = build_config(str(CONFIGS_DIR / "runs" / "demo.yaml"), tuple(overrides), run=run)
    if not cfg.data.clean.inputs:
        cfg.data.clean.inputs = stdlib_inputs()
    t0 = time.time()
    steps = [("clean", run_clean), ("tokenize", run_tokenizer), ("shard", run_shard), ("train", train)]
    for i, (name, fn) in enumerate(steps, 1):
        log.info("demo %d/5: %s (%.0fs elapsed)", i, name, time.time() - t0)
        fn(cfg)
    log.info("demo 5/5: eval (%.0fs elapsed)", time.time() - t0)
    result = run_eval(cfg, checkpoint="latest", max_tokens=cfg.eval.max_tokens)
    print(f"\ncodex demo finished in {time.time() - t0:.0f}s: run directory {run}")
    print(f"validation loss {result['loss']:.4f} nats/token | perplexity {result['perplexity']:.2f} | "
          f"bits per byte {result['bits_per_byte']:.4f} | {result['tokens']} tokens")
    return result
