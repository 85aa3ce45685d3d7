"""Which checkpoint every rank resumes from: rank 0 lists them, every rank checks its share of the
files, and all ranks agree on one intact step or all raise (never two ranks at two steps).

    existing, step = resume(control, run, allow)
"""

from __future__ import annotations

import logging

from codex.core import rundir
from codex.train.checkpoint import folders as checkpoint
from codex.train.distributed.control import ControlPlane

log = logging.getLogger("codex.train")


class ResumeMismatchError(RuntimeError):
    """A rank could not load the checkpoint step rank 0 chose: the job stops rather than diverge."""


def resume(control: ControlPlane, run: str, allow: bool) -> tuple[int | None, int | None]:
    """(existing, step): `existing` is the newest complete checkpoint step (None: none), `step` the
    one every rank loads (None: start fresh). Rank 0 lists the complete checkpoints, newest first;
    for each, every rank checks its share of the files against the sizes and sha256s in DONE
    (checkpoint.damage) and the ranks pool what they found: any damage and every rank moves on to
    the previous checkpoint together; a read error on any rank makes every rank raise
    ResumeMismatchError naming the ranks and paths: never two ranks at two steps.
    `allow` False (train.resume=never): nothing is chosen, `existing` still says what is there."""
    candidates = list(reversed(checkpoint.complete_steps(run))) if control.rank == 0 else None
    candidates = control.broadcast(candidates)
    existing = candidates[0] if candidates else None
    if not allow or existing is None:
        return existing, None
    damaged: list[str] = []
    for step in candidates:
        folder = checkpoint.step_dir(run, step)
        try:
            found = ("damaged", checkpoint.damage(folder, control.rank, control.world))
        except Exception as e:  # a read error after retries: not damage, no fallback
            found = ("error", f"rank {control.rank} could not load {folder} ({e})")
        results = control.gather(found)
        errors = [msg for kind, msg in results if kind == "error"]
        if errors:
            raise ResumeMismatchError(
                f"rank 0 chose checkpoint step {step}, but "
                + "; ".join(errors)
                + ". Every rank needs the same run directory (gs://, or a shared file system); "
                "fix the read and run the same command again"
            )
        problems = [msg for kind, msg in results if msg]
        if not problems:
            if damaged and control.rank == 0:
                log.warning("resuming from %s instead of the newest checkpoint", folder)
            return existing, step
        if control.rank == 0:
            log.warning(
                "checkpoint %s is damaged (%s); every rank tries the previous one",
                folder,
                "; ".join(problems),
            )
        damaged += problems
    raise ResumeMismatchError(
        f"no intact checkpoint under {rundir.checkpoints_dir(run)} (damaged: "
        + "; ".join(damaged)
        + ")"
    )
