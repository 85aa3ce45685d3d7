"""`codex eval --tasks T1,T2`: downstream accuracy through lm-eval-harness, in-process.

    checkpoint -> a temporary Hugging Face directory (model/export_hf.py)
    -> lm_eval.simple_evaluate(model="hf", ...) on the named tasks
    -> RUN/eval/step_N.tasks-<hash>.json, beside the bits-per-byte records of eval/run.py

lm-eval and transformers are optional dependencies (pip install 'codex[hf,tasks]'), imported
here only. docs/eval.md, "Downstream tasks", has the details.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings

import torch

from codex.core import fsio, rundir
from codex.core.config import ConfigError
from codex.core.progress import adopt_library_loggers
from codex.model.export_hf import export_hf
from codex.pipeline.lm_eval_tasks import shipped_tasks
from codex.train.checkpoint.read import load_model
from codex.train.distributed.backend import BackendError
from codex.train.plan.presets import get_preset

log = logging.getLogger("codex.eval")


def run_tasks(cfg) -> dict:
    """Score checkpoint cfg.eval.checkpoint on lm-eval tasks cfg.eval.tasks (at most
    cfg.eval.tasks_limit examples each, 0 = all); write and return the record."""
    tasks = [t for t in cfg.eval.tasks if t]
    device = _device(cfg.train.hardware)  # before anything is loaded: a wrong preset fails at once
    lm_eval, task_manager = _lm_eval(cfg.eval.tasks_path, tasks)
    unknown = [t for t in tasks if t not in task_manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"eval.tasks: unknown lm-eval task {unknown[0]!r} (`lm-eval ls tasks` lists them; "
            "a local task YAML goes in a folder given by --tasks-path)"
        )
    for name in tasks:
        _check_dataset(name, task_manager)
    limit = cfg.eval.tasks_limit or None
    with _no_transformers_bars(), tempfile.TemporaryDirectory(prefix="codex-eval-hf-") as tmp:
        model, run_cfg, info = load_model(cfg, cfg.eval.checkpoint)
        exported = export_hf(model, run_cfg, info, os.path.join(tmp, "hf"))
        del model, run_cfg, info  # lm-eval loads the export: no second copy in memory meanwhile
        batch = cfg.eval.device_batch or 8
        adopt_library_loggers()  # transformers (imported by the export): to the log file
        with _quiet_git_hash(lm_eval):
            results = lm_eval.simple_evaluate(
                model="hf",
                model_args=f"pretrained={exported['path']},dtype=float32,add_bos_token=True",
                tasks=tasks,
                limit=limit,
                batch_size=batch,
                device=device,
                task_manager=task_manager,
                log_samples=False,
            )
    record = _record(cfg, exported, results, lm_eval.__version__)
    key = hashlib.sha256(
        json.dumps([sorted(tasks), limit, cfg.eval.tasks_path]).encode()
    ).hexdigest()[:8]
    out = fsio.join(rundir.eval_dir(cfg.run), f"step_{exported['step']}.tasks-{key}.json")
    fsio.write_json(out, record)
    record["path"] = out
    print(format_tasks_table(record))
    return record


HUB_PROBE_S = 3.0  # how long to wait for the Hugging Face hub before going offline


def _offline_unless_hub_answers() -> None:
    """Go offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE) when the hub does not answer within
    HUB_PROBE_S: offline, datasets and the hub client otherwise retry for about a minute before a
    missing dataset fails; offline, a cached dataset loads and a missing one fails at once."""
    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        return
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_S)
        return
    except urllib.error.HTTPError:
        return  # it answered (any status): online
    except (urllib.error.URLError, OSError):
        pass  # no name, no route, no TLS, no answer in time
    host = endpoint
    log.info("eval: %s does not answer; using only what is cached here (offline)", host)
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    # the libraries read these at import: set what an earlier import of them already read
    for module, name in (
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_DATASETS_OFFLINE"),
    ):
        if module in sys.modules:
            setattr(sys.modules[module], name, True)


def _lm_eval(tasks_path: str, tasks: list[str]):
    """lm_eval and a TaskManager that knows `tasks`: only tasks_path's YAMLs when they are all
    there (indexing lm-eval's ~15k built-in tasks takes ~15 s), else those plus the built-in
    ones."""
    _offline_unless_hub_answers()
    try:
        import lm_eval  # optional dependency: only codex eval --tasks needs it
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError(
            "codex eval --tasks needs lm-eval-harness: pip install 'codex[hf,tasks]'"
        ) from None
    adopt_library_loggers()  # datasets, huggingface_hub (imported by lm_eval): to the log file
    if tasks_path and not os.path.isdir(tasks_path):
        raise ConfigError(f"eval.tasks_path: {tasks_path} is not a directory of task YAMLs")
    paths = [p for p in (tasks_path, shipped_tasks()) if p]
    local = TaskManager(include_path=paths, include_defaults=False)
    if all(t in local.all_tasks for t in tasks):
        return lm_eval, local
    return lm_eval, TaskManager(include_path=paths)


@contextlib.contextmanager
def _no_transformers_bars():
    """transformers' bars for writing the export and loading it back (instant, and not the
    stage's progress) are off while the tasks run; lm-eval's own (requests scored) stay."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # export_hf says how to install it
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _quiet_git_hash(lm_eval):
    """lm-eval records the git commit of the working directory by running `git describe` with the
    terminal as its stderr: outside a git checkout the user sees `fatal: not a git repository`.
    git has no switch or environment variable that silences that, and lm-eval no option that skips
    the lookup, so for the length of simple_evaluate its lookup is replaced by the same one with
    git's stderr discarded (the recorded hash is unchanged). A lm-eval without that function is
    left as it is."""
    evaluator = sys.modules.get("lm_eval.evaluator") or importlib.import_module("lm_eval.evaluator")
    original = getattr(evaluator, "get_git_commit_hash", None)
    if original is None:
        yield
        return

    def get_git_commit_hash():
        try:
            out = subprocess.run(
                ["git", "describe", "--always"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                check=True,
            )
            return out.stdout.strip().decode()
        except (subprocess.CalledProcessError, OSError):
            from lm_eval.loggers.utils import get_commit_from_path

            return get_commit_from_path(os.getcwd())  # lm-eval's own fallback

    evaluator.get_git_commit_hash = get_git_commit_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def _check_dataset(name: str, task_manager) -> None:
    """Load task `name` (its dataset) once before the model is exported, so a dataset missing on
    this machine is one line naming the task. simple_evaluate loads it again from the local
    cache."""
    try:
        # 0.4.13 deprecates it for load(), which 0.4.5 does not have
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            task_manager.load_task_or_group([name])
    # datasets raises many kinds (ConnectionError, DatasetNotFoundError, ...)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"task {name}: its dataset could not be loaded ({reason}); "
            f"run `codex eval --tasks {name}` "
            "once on a machine with network access and copy its Hugging Face cache "
            "(~/.cache/huggingface, or $HF_HOME) here"
        ) from None


def _device(hardware: str) -> str:
    """lm-eval's device for the hardware preset: no silent fallback from a GPU preset to the CPU,
    and no TPU (lm-eval's hf model has no XLA device)."""
    preset = get_preset(hardware)
    if preset.kind == "tpu":
        raise ConfigError(
            f"codex eval --tasks runs on the CPU or CUDA (lm-eval's hf model has no XLA device); "
            f"'{preset.name}' is a TPU preset: pass --hardware cpu"
        )
    if preset.kind == "cuda" and not torch.cuda.is_available():
        raise BackendError(
            f"hardware preset '{preset.name}' needs a CUDA GPU, but torch found none. "
            "Fix: run on a GPU machine, or pass --hardware cpu."
        )
    return "cuda" if preset.kind == "cuda" else "cpu"


def _record(cfg, exported: dict, results: dict, version: str) -> dict:
    """Per task: every metric lm-eval reported (acc, acc_norm, their stderr), without the ',none'
    filter suffix; plus the checkpoint and the settings that make the numbers comparable."""
    per_task = {}
    for task, metrics in results["results"].items():
        clean: dict[str, int | float | None] = {
            k.split(",")[0]: v
            for k, v in metrics.items()
            if "," in k and isinstance(v, (int, float))
        }
        clean["samples"] = (
            int(results.get("n-samples", {}).get(task, {}).get("effective", 0)) or None
        )
        per_task[task] = clean
    return {
        "step": exported["step"],
        "tasks": per_task,
        "limit": int(cfg.eval.tasks_limit),
        "tasks_path": cfg.eval.tasks_path or None,
        "lm_eval_version": version,
        "checkpoint": exported["checkpoint"],
        "train_tokens": exported["train_tokens"],
        "architecture": exported["architecture"],
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config_fingerprint": exported["config_fingerprint"],
    }


def format_tasks_table(r: dict) -> str:
    rows = [
        (
            task,
            ", ".join(
                f"{k} {v:.4f}" for k, v in sorted(m.items()) if k != "samples" and v is not None
            )
            + (f" ({m['samples']} examples)" if m.get("samples") else ""),
        )
        for task, m in sorted(r["tasks"].items())
    ]
    rows.insert(0, ("checkpoint", f"step {r['step']} ({r['checkpoint']})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
