"""`codex demo`: clean -> tokenize -> shard -> train -> eval on a corpus every machine has.

The corpus is the Python standard library's own .py sources, located through sysconfig (no
download), minus site-packages (which holds whatever the user installed, so results would vary).
Every stage runs through the same function as its `codex` command, with configs/runs/demo.yaml.
"""

from __future__ import annotations

import functools
import logging
import os
import sysconfig
import time
from collections.abc import Callable

from codex.core import fsio, rundir
from codex.core.config import CONFIGS_DIR, Config, build_config
from codex.core.progress import log_to_file
from codex.pipeline.clean.clean import run_clean
from codex.pipeline.shard.manifest import existing_state
from codex.pipeline.shard.shard import run_shard
from codex.pipeline.tokenizer.tokenizer import load_meta, run_tokenizer

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


def drop_stale_outputs(run: str) -> None:
    """Remove the demo's shards, checkpoints and eval when they were made with another tokenizer.

    `codex data shard` refuses to mix two tokenizers in one folder (it never deletes a user's
    shards). The demo owns its run directory, so after an upgrade that retrains the tokenizer it
    starts its downstream stages over instead of failing.
    """
    shards = rundir.shards_dir(run)
    made_with = (existing_state(shards) or {}).get("settings", {}).get("tokenizer_sha256")
    current = load_meta(rundir.tokenizer_dir(run))["sha256"]
    if made_with is None or made_with == current:
        return
    log.warning(
        "demo: %s was made with another tokenizer (%s, now %s): removing the demo's shards, "
        "checkpoints, eval and metrics to redo them",
        shards,
        made_with[:12],
        current[:12],
    )
    for path in (
        shards,
        rundir.checkpoints_dir(run),
        rundir.eval_dir(run),
        rundir.metrics_path(run),
    ):
        fsio.rm(path, recursive=True)


def run_demo(run: str, overrides=()) -> dict:
    # torch (seconds to import) only when the demo runs: `codex` itself imports this module
    from codex.eval.evaluate import evaluate
    from codex.eval.plot import plot_loss
    from codex.eval.run import run_eval
    from codex.train.loop import train

    cfg = build_config(str(CONFIGS_DIR / "runs" / "demo.yaml"), tuple(overrides), run=run)
    if not cfg.data.clean.inputs:
        cfg.data.clean.inputs = stdlib_inputs()
    log_to_file(cfg.run, "codex demo")
    t0 = time.time()
    steps: list[tuple[str, Callable[[Config], object]]] = [
        ("clean", run_clean),
        ("tokenize", run_tokenizer),
        ("shard", run_shard),
        ("train", functools.partial(train, evaluate=evaluate, plot=plot_loss)),
    ]
    for i, (name, fn) in enumerate(steps, 1):
        log.info("demo %d/5: %s (%.0fs elapsed)", i, name, time.time() - t0)
        if name == "shard":
            drop_stale_outputs(cfg.run)
        fn(cfg)
    log.info("demo 5/5: eval (%.0fs elapsed)", time.time() - t0)
    result = run_eval(cfg)
    print(f"\ncodex demo finished in {time.time() - t0:.0f}s: run directory {run}")
    print(
        f"validation loss {result['loss']:.4f} nats/token | "
        f"perplexity {result['perplexity']:.2f} | "
        f"bits per byte {result['bits_per_byte']:.4f} | {result['tokens']} tokens"
    )
    return result
