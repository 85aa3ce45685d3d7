"""Training metrics: what a log line measures and where it goes (RUN/metrics.jsonl, wandb).

    window = LossWindow(backend, accum, saved)   # saved: a checkpoint's log_window (exact resume)
    timer = StepTimer(backend, step, tokens)
    window.add(loss)                             # every micro-batch: summed on the device
    with timer.pause(): validate or save         # left out of tokens/s, kept in the wall time
    loss = window.take(step); rates = timer.lap(step, tokens)    # a log step: mean, new window
    logger = make_logger(cfg, is_main, resume_step, config_dict); logger.log("train", step, ...)

Nothing here reads the device inside a step, so tokens/s counts finished work (docs/training.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Literal, cast

import torch

from codex.core import fsio, rundir
from codex.core.progress import Progress, adopt_library_loggers
from codex.train.distributed.backend import Backend, replica_mean


class LossWindow:
    """The training loss summed on the device since the last log line (first step `since`).
    The sum is of micro-batch losses, `accum` a step; a window saved at another accum (a resume
    with another batch_tokens or world size) is rescaled to this one, so the mean stays the mean
    of the steps' losses."""

    def __init__(self, backend: Backend, accum: int, saved: dict):
        self.backend, self.accum = backend, accum
        loss_sum = float(saved["loss_sum"]) * accum / int(saved.get("accum", accum))
        # A host-to-device copy, not a computation: on XLA it adds no program to compile, fresh or
        # resumed (a resumed run carries the fp32 sum of its unfinished window).
        self.sum = torch.tensor(loss_sum, dtype=torch.float32).to(backend.device)
        self.since = int(saved["since"])  # may precede the resume step

    def add(self, loss: torch.Tensor) -> None:
        self.sum += loss.detach()

    def mean(self, step: int) -> torch.Tensor:
        """The mean micro-batch loss over replicas since `since` (lazy: the next sync computes it).
        The sum is the only cross-rank transfer on logging steps."""
        return replica_mean(self.backend, self.sum) / (self.accum * (step - self.since))

    def take(self, step: int) -> torch.Tensor:
        """The window's mean (lazy), and a new window from `step`, with no device work now: the
        sum is replaced by a zero copied from the host, not zeroed in place (on XLA an in-place
        zero is a program of its own, and a read of it a wait for the device)."""
        mean = self.mean(step)
        self.sum = torch.zeros((), dtype=torch.float32).to(self.backend.device)
        self.since = step
        return mean

    def state(self) -> dict:
        """For a checkpoint; every rank must call it (the partial sum is averaged over replicas)."""
        loss_sum = float(replica_mean(self.backend, self.sum))
        return {"loss_sum": loss_sum, "since": self.since, "accum": self.accum}


class StepTimer:
    """Tokens/s between log lines, read after the device has really finished. Pauses (validation,
    checkpoints) are left out of the training time and kept in the wall time."""

    def __init__(self, backend: Backend, step: int, tokens: int):
        self.backend = backend
        self.last: dict = {}
        backend.synchronize()
        self._start(time.perf_counter(), step, tokens)

    def _start(self, now: float, step: int, tokens: int) -> None:
        self.t0, self.step0, self.tokens0, self.paused = now, step, tokens, 0.0

    @contextlib.contextmanager
    def pause(self):
        self.backend.synchronize()
        t = time.perf_counter()
        try:
            yield
        finally:
            self.backend.synchronize()
            self.paused += time.perf_counter() - t

    def lap(self, step: int, tokens: int, sync: bool = True) -> dict:
        """Rates since the last lap, up to the loop's `step`. sync False (lagged logs): no drain;
        the caller has just read values an earlier step computed, so in steady state the host
        and the device run at one rate and the window between two such reads measures it. A lap
        with no step since the last one repeats the last rates. The next window starts at this
        clock, so the time spent writing the log line itself is counted in it."""
        if sync:
            self.backend.synchronize()
        if step == self.step0 and self.last:
            return self.last
        now = time.perf_counter()
        wall = now - self.t0
        dt = wall - self.paused
        done = tokens - self.tokens0
        out = {
            "tokens_per_s": done / dt,
            "tokens_per_s_wall": done / wall,
            "step_time_s": dt / (step - self.step0),
        }
        self._start(now, step, tokens)
        self.last = out
        return out


log = logging.getLogger("codex.metrics")

FLUSH_LINES = 50  # gs://: lines per appended chunk at most
FLUSH_SECONDS = 60.0  # gs://: and no line waits longer than this (checked when the next line comes)


def _clean(v):
    """JSON-safe numbers (NaN/inf become strings: json.dumps would write invalid JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    def __init__(
        self, run: str, enabled: bool = True, wandb_run=None, resume_step: int | None = None
    ):
        self.run = run
        self.path = rundir.metrics_path(run)
        self.enabled = enabled
        self.wandb_run = wandb_run
        self.lines: list[str] = []  # what the file held when opened (after the resume cut)
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
            fsio.write_text(self.path, "".join(line + "\n" for line in self.lines))
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
            if (
                len(self._pending) >= FLUSH_LINES
                or time.monotonic() - self._flushed_at >= FLUSH_SECONDS
            ):
                self.flush()
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(
                    {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
                    | {"tokens": int(tokens)},
                    step=int(step),
                )
            except Exception as e:  # a wandb failure never stops training
                self._wandb_failed(e)

    def _wandb_failed(self, e: Exception) -> None:
        log.warning(
            "wandb failed (%s: %s); continuing without wandb (metrics.jsonl still has everything)",
            type(e).__name__,
            e,
        )
        self.wandb_run = None

    def flush(self) -> None:
        """gs://: append the buffered lines as one chunk (upload, compose onto the file, delete the
        chunk)."""
        self._flushed_at = time.monotonic()
        if not self._pending:
            return
        data = "".join(line + "\n" for line in self._pending)
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
    return setting  # online or offline (config.check_values allows only these and auto/off)


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

        adopt_library_loggers()  # wandb's own log lines: to RUN/logs/train.log as well
        directory = wandb_dir(cfg.run)
        os.makedirs(directory, exist_ok=True)
        # One wandb id per run directory, so a resumed run continues the same wandb run.
        run_id = "codex-" + hashlib.sha1(str(cfg.run).encode()).hexdigest()[:12]
        wandb_run = wandb.init(
            project=cfg.train.wandb_project,
            dir=directory,
            mode=cast(Literal["online", "offline"], mode),  # wandb_mode: never "disabled"
            id=run_id,
            resume="allow",
            config=config_dict,
            name=os.path.basename(str(cfg.run).rstrip("/")),
            settings=wandb_settings(wandb),
        )
    except Exception as e:
        log.warning(
            "wandb did not start (%s: %s); "
            "training without it (metrics.jsonl still has everything)",
            type(e).__name__,
            e,
        )
        return None
    if mode == "online" and wandb_run.url:
        log.info("wandb run: %s", wandb_run.url)
    else:
        folder = os.path.dirname(wandb_run.dir)
        log.info("wandb offline run: %s (`wandb sync %s` uploads it)", folder, folder)
    return wandb_run


def wandb_settings(wandb):
    """Quiet wandb: its ~25 `wandb: ...` lines (printed, not logged) go to its python logger
    instead (the run's debug.log and RUN/logs/train.log); start_wandb logs where the run is, in one
    line. CODEX_DEBUG=1 keeps wandb's own output."""
    if os.environ.get("CODEX_DEBUG"):
        return wandb.Settings()
    return wandb.Settings(silent=True)


def make_logger(cfg, is_main: bool, resume_step: int | None, config_dict: dict) -> MetricsLogger:
    if not is_main:
        return MetricsLogger(cfg.run, enabled=False)
    return MetricsLogger(
        cfg.run, enabled=True, wandb_run=start_wandb(cfg, config_dict), resume_step=resume_step
    )


@dataclass
class TrainLine:
    """A log step's values, still on the device until the line is written."""

    step: int
    tokens: int
    lr: float
    loss: torch.Tensor  # the mean loss since the last line
    grad_norm: torch.Tensor


@dataclass
class Meters:
    """Where the loop's measurements go: the loss window, the timer, the log, the progress bar."""

    window: LossWindow
    timer: StepTimer
    metrics: MetricsLogger
    progress: Progress
    pending: TrainLine | None = None  # lagged_logs: the line the next log step writes

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
