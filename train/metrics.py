"""Training metrics: RUN/metrics.jsonl on rank 0 (always), and wandb (optional, never fatal).

    logger = make_logger(cfg, is_main=backend.is_main, resume_step=step)
    logger.log("train", step, tokens, loss=..., lr=...)
    logger.close()

metrics.jsonl holds one JSON object a line: {"kind": "train"|"val", "step", "tokens", ...}. On
resume, lines from steps after the checkpoint (written by the run that was killed) are dropped so
the file reads like one uninterrupted run. On gs:// the file is rewritten whole at each flush
(object stores cannot append; the file is small).

wandb: train.wandb = auto (online when WANDB_API_KEY is set or WANDB_MODE=online, else offline),
online, offline, or off. Any wandb exception is logged once and wandb is switched off; training
goes on. Only rank 0 logs anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os

from codex import fsio, rundir

log = logging.getLogger("codex.metrics")


def _clean(v):
    """JSON-safe numbers (NaN/inf become strings: json.dumps would write invalid JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    def __init__(self, run: str, enabled: bool = True, wandb_run=None, resume_step: int | None = None):
        self.run = run
        self.path = rundir.metrics_path(run)
        self.enabled = enabled
        self.wandb_run = wandb_run
        self.lines: list[str] = []     # the whole file, kept for gs:// rewrites
        self._local = None
        if not enabled:
            return
        if fsio.exists(self.path):
            kept = []
            for line in fsio.read_text(self.path).splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill mid-write
                if resume_step is not None and int(rec.get("step", 0)) > resume_step:
                    continue
                kept.append(line)
            self.lines = kept
            if resume_step is None:
                self.lines = []  # a fresh run (no checkpoint): start the file over
            fsio.write_text(self.path, "".join(l + "\n" for l in self.lines))
        if not fsio.is_remote(self.path):
            fsio.makedirs(os.path.dirname(os.path.abspath(self.path)))
            self._local = open(self.path, "a", buffering=1)  # line-buffered append

    def log(self, kind: str, step: int, tokens: int, **values) -> None:
        if not self.enabled:
            return
        rec = {"kind": kind, "step": int(step), "tokens": int(tokens)}
        rec.update({k: _clean(v) for k, v in values.items()})
        line = json.dumps(rec)
        self.lines.append(line)
        if self._local is not None:
            self._local.write(line + "\n")
        else:
            fsio.write_text(self.path, "".join(l + "\n" for l in self.lines))
        if self.wandb_run is not None:
            try:
                self.wandb_run.log({f"{kind}/{k}": v for k, v in values.items()
                                    if isinstance(v, (int, float))} | {"tokens": int(tokens)}, step=int(step))
            except Exception as e:  # a wandb failure never stops training
                self._wandb_failed(e)

    def _wandb_failed(self, e: Exception) -> None:
        log.warning("wandb failed (%s: %s); continuing without wandb (metrics.jsonl still has everything)",
                    type(e).__name__, e)
        self.wandb_run = None

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as e:
                self._wandb_failed(e)
            self.wandb_run = None


def wandb_mode(setting: str) -> str | None:
    """train.wandb -> a wandb mode, or None for off."""
    setting = str(setting).lower()
    # YAML reads a bare `off` (--set train.wandb=off) as the boolean false, which the str field
    # then holds as "False": accept it as off, and "True" as auto.
    if setting in ("off", "false", "no", "disabled"):
        return None
    if setting in ("true", "on", "yes"):
        setting = "auto"
    if setting == "off":
        return None
    if setting == "auto":
        if os.environ.get("WANDB_MODE") in ("offline", "online", "disabled"):
            return None if os.environ["WANDB_MODE"] == "disabled" else os.environ["WANDB_MODE"]
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    if setting in ("online", "offline"):
        return setting
    from codex.config import ConfigError

    raise ConfigError(f"train.wandb: expected auto, online, offline or off, got {setting!r}")


def wandb_dir(run: str) -> str:
    """The folder wandb.init(dir=...) puts its wandb/ folder in: RUN locally (RUN/wandb/...), the
    working directory for a gs:// run (wandb writes local files; `wandb sync` uploads them)."""
    return os.path.abspath(run if not fsio.is_remote(run) else ".")


def start_wandb(cfg, config_dict: dict):
    """A wandb run, or None (off, or wandb failed to start: logged, training continues)."""
    mode = wandb_mode(cfg.train.wandb)
    if mode is None:
        return None
    try:
        import wandb

        directory = wandb_dir(cfg.run)
        os.makedirs(directory, exist_ok=True)
        # One wandb id per run directory, so a resumed run continues the same wandb run.
        run_id = "codex-" + hashlib.sha1(str(cfg.run).encode()).hexdigest()[:12]
        return wandb.init(project=cfg.train.wandb_project, dir=directory, mode=mode, id=run_id,
                          resume="allow", config=config_dict, name=os.path.basename(str(cfg.run).rstrip("/")))
    except Exception as e:
        log.warning("wandb did not start (%s: %s); training without it (metrics.jsonl still has everything)",
                    type(e).__name__, e)
        return None


def make_logger(cfg, is_main: bool, resume_step: int | None, config_dict: dict) -> MetricsLogger:
    if not is_main:
        return MetricsLogger(cfg.run, enabled=False)
    return MetricsLogger(cfg.run, enabled=True, wandb_run=start_wandb(cfg, config_dict), resume_step=resume_step)
