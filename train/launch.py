"""The backend a hardware preset runs on, opened and closed around a command's work.

    with open_backend(cfg) as backend:   # CPU/CUDA: train/distributed/backend.py;
                                         # TPU: train/xla/backend.py
        ...

Only this module knows both backends, so neither imports the other.
"""

from __future__ import annotations

import contextlib

from codex.core.progress import command_log
from codex.train.distributed.backend import Backend, BackendError, make_torch_backend
from codex.train.plan.presets import get_preset
from codex.train.plan.threads import apply_threads
from codex.train.plan.world import launch_env
from codex.train.xla.flash import flash_unavailable


def make_backend(cfg, xla_spawned: bool = False) -> Backend:
    """The backend for cfg.train.hardware (`xla_spawned`: this process is one of
    train.xla_mode=spawn's, started by spawn_train)."""
    preset = get_preset(cfg.train.hardware)
    threads = apply_threads(cfg.train.threads)  # the host side of every preset
    if launch_env()[0] == 0:
        command_log().info("threads: %s", threads.describe())  # train's, eval's or sample's
    if preset.kind == "tpu":
        from codex.train.xla import (
            backend as xla_backend,  # imports torch_xla: only for TPU presets
        )

        return xla_backend.make_xla_backend(cfg, preset, spawned=xla_spawned)
    if cfg.model.attention == "flash":
        raise BackendError(
            flash_unavailable(f"hardware preset '{preset.name}' is a {preset.kind} preset")
        )
    return make_torch_backend(cfg, preset)


@contextlib.contextmanager
def open_backend(cfg, xla_spawned: bool = False):
    """make_backend(cfg), closed on leaving: the clean-exit barrier only when the body succeeded.
    A rank that raised must not wait for its peers: they may sit in a collective it will never
    join, and its exit fails them at once instead of after a timeout."""
    backend = make_backend(cfg, xla_spawned=xla_spawned)
    ok = False
    try:
        yield backend
        ok = True
    finally:
        backend.close(ok)
