"""What a training log line measures: the loss averaged since the last line, and the throughput.

    window = LossWindow(backend, accum, saved)   # saved: a checkpoint's log_window (exact resume)
    timer = StepTimer(backend, step, tokens)
    ... window.add(loss) every micro-batch ...
    with timer.pause(): validate or save          # left out of tokens/s, kept in the wall time
    loss = window.mean(step); rates = timer.lap(step, tokens); window.reset(step)

Nothing here reads the device inside a step: the loss is summed on the device and read every
log_every steps only, after a blocking sync, so tokens/s counts finished work.
"""

from __future__ import annotations

import contextlib
import time

import torch

from train.backend import Backend, replica_mean


class LossWindow:
    """The training loss summed on the device since the last log line (first step `since`)."""

    def __init__(self, backend: Backend, accum: int, saved: dict):
        self.backend, self.accum = backend, accum
        # A host-to-device copy, not a computation: on XLA it adds no program to compile, fresh or
        # resumed (a resumed run carries the fp32 sum of its unfinished window).
        self.sum = torch.tensor(float(saved["loss_sum"]), dtype=torch.float32).to(backend.device)
        self.since = int(saved["since"])   # may precede the resume step

    def add(self, loss: torch.Tensor) -> None:
        self.sum += loss.detach()

    def mean(self, step: int) -> torch.Tensor:
        """The mean micro-batch loss over replicas since `since` (lazy: the next sync computes it).
        The sum is the only cross-rank transfer on logging steps."""
        return replica_mean(self.backend, self.sum) / (self.accum * (step - self.since))

    def reset(self, step: int) -> None:
        self.sum.zero_()
        self.since = step
        # XLA: the zeroing runs now (its own program), so the next step stays the usual one.
        self.backend.synchronize()

    def state(self) -> dict:
        """For a checkpoint; every rank must call it (the partial sum is averaged over replicas)."""
        return {"loss_sum": float(replica_mean(self.backend, self.sum)), "since": self.since}


class StepTimer:
    """Tokens/s between log lines, read after the device has really finished. Pauses (validation,
    checkpoints) are left out of the training time and kept in the wall time."""

    def __init__(self, backend: Backend, step: int, tokens: int):
        self.backend = backend
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

    def lap(self, step: int, tokens: int) -> dict:
        """Rates since the last lap. The next window starts at this clock, so the time spent writing
        the log line itself is counted in it."""
        self.backend.synchronize()
        now = time.perf_counter()
        wall = now - self.t0
        dt = wall - self.paused
        done = tokens - self.tokens0
        out = {"tokens_per_s": done / dt, "tokens_per_s_wall": done / wall, "step_time_s": dt / (step - self.step0)}
        self._start(now, step, tokens)
        return out
