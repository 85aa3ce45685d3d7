"""Training metrics: RUN/metrics.jsonl on rank 0 (always), and wandb (optional, never fatal).

    logger = make_logger(cfg, is_main=backend.is_main, resume_step=step)
    logger.log("train", step, tokens, loss=..., lr=...)
    logger.close()

metrics.jsonl holds one JSON object a line: {"kind": "train"|"val", "step", "tokens", ...}. On
resume, lines from steps after the checkpoint (written by the run that was killed) are dropped so
the file reads like one uninterrupted run. On gs:// (objects cannot be appended to) new lines are
buffered and appended in chunks: a chunk object is uploaded and composed onto metrics.jsonl (GCS
compose, server-side), so a flush costs the chunk, not the file. A flush happens every FLUSH_LINES
lines or FLUSH_SECONDS, at close, and before every checkpoint (flush()), so a resume never misses
lines older than its checkpoint.

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
import time

from codex import fsio, rundir

log = logging.getLogger("codex.metrics")

FLUSH_LINES = 50       # gs://: lines per appended chunk at most
FLUSH_SECONDS = 60.0   # gs://: and no line waits longer than this (checked when the next line comes)


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
        self.lines: list[str] = []     # what the file held when opened (after the resume cut)
        self._pending: list[str] = []  # gs://: lines not appended yet
        self._flushed_at = time.monotonic()
        self._chunks = 0
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
        if self._local is not None:
            self._local.write(line + "\n")
        else:
            self._pending.append(line)
            if len(self._pending) >= FLUSH_LINES or time.monotonic() - self._flushed_at >= FLUSH_SECONDS:
                self.flush()
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

    def flush(self) -> None:
        """gs://: append the buffered lines as one chunk (upload, compose onto the file, delete the chunk)."""
        self._flushed_at = time.monotonic()
        if not self._pending:
            return
        data = "".join(l + "\n" for l in self._pending)
        if not fsio.exists(self.path):
            fsio.write_text(self.path, data)
        else:
            fs, path = fsio.filesystem(self.path)
            chunk = f"{path}.chunk-{os.getpid()}-{self._chunks}"
            self._chunks += 1
            with fs.open(chunk, "wb") as f:
                f.write(data.encode())
            try:
                fs.merge(path, [path, chunk])
            finally:
                fs.rm(chunk)
            fs.invalidate_cache(path)
        self._pending = []

    def close(self) -> None:
        if self.enabled and self._local is None:
            self.flush()
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
    if setting == "off":
        return None
    if setting == "auto":
        if os.environ.get("WANDB_MODE") in ("offline", "online", "disabled"):
            return None if os.environ["WANDB_MODE"] == "disabled" else os.environ["WANDB_MODE"]
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return setting   # online or offline (config.check_values allows only these and auto/off)


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
