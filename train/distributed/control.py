"""The host-side control plane: one gloo process group that every backend uses for decisions.

    control = ControlPlane(group, rank, world)   # made by make_torch_backend / make_xla_backend
    control.barrier()                            # host barrier (every backend, XLA SPMD included)
    control.any_flag(flag)                       # the stop flag: True everywhere if any rank's is
    control.check_same_config(to_dict(cfg))      # all ranks run the same resolved config
    stop = StopFlag().install()                  # SIGTERM/SIGINT: finish the step, save, return

It runs on the host and reads no device value, so a per-step stop check never drains an
accelerator. Its group on each backend, and its timeouts: docs/cuda.md.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from codex.core import fsio
from codex.core.config import ConfigError

log = logging.getLogger("codex.train")


CONTROL_TIMEOUT_S = float(os.environ.get("CODEX_CONTROL_TIMEOUT_S", "600"))


def control_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=CONTROL_TIMEOUT_S)


@dataclass
class ControlPlane:
    """Host-side collectives over a gloo group; with world == 1 every call is local."""

    group: Any = None
    rank: int = 0
    world: int = 1

    def groups(self) -> list:
        """The gloo group this control plane owns: its timeout stays CONTROL_TIMEOUT_S when the
        backend shortens the others' after the first step."""
        return [self.group] if self.group is not None else []

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def any_flag(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank. Every rank calls it once per step,
        so all stop at the same step."""
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (a small picklable value)."""
        if self.world == 1:
            return obj
        box = [obj]
        # src is a global rank; the control group's rank 0 is global rank 0 (every group made here
        # spans all ranks).
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def check_same_config(self, config: dict) -> None:
        """ConfigError on every rank when any rank's resolved config differs from rank 0's,
        naming the ranks and the keys that differ."""
        flat = _flatten(config)
        digest = hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()
        digests = self.gather(digest)
        if len(set(digests)) == 1:
            return
        configs = self.gather(flat)
        ref = configs[0]
        parts = []
        for r, c in enumerate(configs):
            if digests[r] == digests[0]:
                continue
            keys = sorted(k for k in ref.keys() | c.keys() if ref.get(k) != c.get(k))
            shown = ", ".join(f"{k}={c.get(k)!r} (rank 0: {ref.get(k)!r})" for k in keys[:5])
            more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
            parts.append(f"rank {r}: {shown}" + more)
        raise ConfigError(
            "the ranks of this job run different configs: "
            + "; ".join(parts)
            + ". Every host must get the same command, config files and --set flags"
        )

    def check_shared_dir(self, folder: str) -> None:
        """ConfigError on every rank unless every rank reads the file rank 0 just wrote in
        `folder`: proof that the run directory is one folder for the whole job, not one per
        node (each would resume its own checkpoints, or none, and DONE would exist on one)."""
        if self.world == 1:
            return
        name = f".codex-shared-{self.broadcast(uuid.uuid4().hex if self.rank == 0 else None)}"
        path = fsio.join(folder, name)
        written = ""
        if self.rank == 0:
            try:
                fsio.makedirs(folder)
                fsio.write_text(path, name)
            except Exception as e:  # any failure: every rank must hear of it, not hang
                written = f"rank 0 could not write {path} ({e})"
        written = self.broadcast(written)
        if written:
            raise ConfigError(f"{written}: --run must be a folder every rank can write")
        try:
            seen = fsio.read_text(path) == name
        except Exception:  # not there, or not readable: this rank does not share the folder
            seen = False
        missing = [r for r, ok in enumerate(self.gather(seen)) if not ok]
        if self.rank == 0:
            with contextlib.suppress(Exception):
                fsio.rm(path)
        if missing:
            raise ConfigError(
                f"rank(s) {', '.join(map(str, missing))} cannot see {path}, which rank 0 wrote: "
                f"--run {folder} is not one folder for the whole job. Fix: use a bucket every node "
                "reads (--run gs://BUCKET/RUN) or a file system every node mounts"
            )


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class StopFlag:
    """Set by SIGTERM/SIGINT (a spot VM gets ~30 s); the loop finishes the current step, saves and
    returns. Every rank stops at the same step: the loop checks `backend.any_flag(stop.is_set)`."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._old: dict = {}

    @property
    def is_set(self) -> bool:
        return self.signal_name is not None

    def install(self) -> StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a notebook worker)
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: finishing this step, then saving a checkpoint", self.signal_name)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def rank_tag(control: ControlPlane) -> str:
    """ "rank r/n: " for per-rank log lines of a multi-process job ("" on one process)."""
    return f"rank {control.rank}/{control.world}: " if control.world > 1 else ""


# "RANK:STEP": that control-plane rank raises before that step (tests)
FAULT_ENV = "CODEX_TEST_RAISE_AT"
# "RANK:STEP:SECONDS[,...]": that rank sleeps that long before that step, a hung peer (tests)
STALL_ENV = "CODEX_TEST_STALL_AT"


def injected_step_fault(control: ControlPlane, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{control.rank}:{step}":
        raise RuntimeError(
            f"{FAULT_ENV}={spec}: injected failure on rank {control.rank} at step {step}"
        )
    for stall in filter(None, os.environ.get(STALL_ENV, "").split(",")):
        rank, at, seconds = stall.split(":")
        if (int(rank), int(at)) == (control.rank, step):
            log.warning("%s: rank %s stalls %s s before step %d", STALL_ENV, rank, seconds, step)
            time.sleep(float(seconds))
