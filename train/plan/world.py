"""The launch's world: torchrun's ranks, the environment torch_xla reads at import, and the rule
that a job on several hosts shares one run directory."""

from __future__ import annotations

import os

from codex.core import fsio
from codex.core.config import ConfigError
from codex.train.plan.presets import get_preset

# Environment torch_xla reads once, when it is first imported: set it before anything imports
# torch_xla (the run lock does, to ask a multi-host TPU VM for its worker id), or it has no effect.
# XLA_NO_SPECIAL_SCALARS: the Python scalars 0 and 1 stay device data like any other scalar,
# instead of constants baked into the graph (a learning rate reaching 0 or 1 would compile anew).
XLA_IMPORT_ENV = {"XLA_NO_SPECIAL_SCALARS": "1"}


def set_xla_import_env() -> None:
    for key, value in XLA_IMPORT_ENV.items():
        os.environ.setdefault(key, value)


def launch_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's environment, or 1
    process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, world, local_rank, local_world


def require_shared_run_dir(cfg) -> None:
    """A job on several hosts (a multi-host TPU preset, or torchrun over several nodes) runs the
    same command on every host, and they must all read and write one run directory: a local path
    is one folder per host (each resumes its own checkpoints, or none), so it is refused unless
    the user says it is a shared disk (train.shared_run_dir). The loop then proves it
    (ControlPlane.check_shared_dir)."""
    if fsio.is_remote(cfg.run) or cfg.train.shared_run_dir:
        return
    preset = get_preset(cfg.train.hardware)
    _, world, _, local_world = launch_env()
    if preset.hosts > 1:
        where = f"--hardware {preset.name} runs on {preset.hosts} hosts"
    elif world != local_world:
        where = (
            f"torchrun started {world} ranks, {local_world} on this node, so on several nodes "
            "(WORLD_SIZE != LOCAL_WORLD_SIZE)"
        )
    else:
        return
    raise ConfigError(
        f"{where}, but --run {cfg.run} is a local "
        "path that each host would see as its own folder. Fix: use a bucket every host reads "
        "(--run gs://BUCKET/RUN), or, when that path is a disk all hosts share (NFS, Filestore), "
        "say so with --set train.shared_run_dir=true"
    )
