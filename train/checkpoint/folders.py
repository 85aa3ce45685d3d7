"""Checkpoint folders: RUN/checkpoints/step_NNNNNNNN/ in torch.distributed.checkpoint's (DCP)
format, written by every rank in parallel, local or gs://. A checkpoint counts only once rank 0
has written its DONE marker (each file's size and sha256), last.

`save` writes one (the tensors through dcp.py), `damage` checks a rank's share of its files,
`newest_intact` walks back over damaged ones, `load` reads one whole into one process, and
retention (`prune`) keeps the last `keep_last` and every multiple of `keep_every`. Background
saves: async_save.py. The format and its rules: docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time

import torch

from codex.core import fsio, rundir
from codex.train.checkpoint import dcp as dcp_io
from codex.train.distributed.control import ControlPlane

log = logging.getLogger("codex.checkpoint")

STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"step_(\d{8,})$")


def step_dir(run: str, step: int) -> str:
    return fsio.join(rundir.checkpoints_dir(run), f"step_{step:08d}")


def _all_steps(run: str) -> list[tuple[int, str]]:
    """(step, dir) of every step_* folder, complete or not, oldest first."""
    return _all_steps_in(rundir.checkpoints_dir(run))


def _all_steps_in(ckpt_dir: str) -> list[tuple[int, str]]:
    out = []
    for path in fsio.listdir(ckpt_dir):
        m = _STEP_DIR.search(path.rstrip("/"))
        if m:
            out.append((int(m.group(1)), path.rstrip("/")))
    return sorted(out)


def complete_steps(run: str) -> list[int]:
    """Steps whose DONE marker exists, oldest first."""
    return [s for s, d in _all_steps(run) if fsio.exists(fsio.join(d, "DONE"))]


def latest_step(run: str) -> int | None:
    """The newest step with a DONE marker (load() also checks the file is intact), or None."""
    steps = complete_steps(run)
    return steps[-1] if steps else None


def save(run: str, state: dict, keep_last: int = 3, keep_every: int = 0, control=None) -> str:
    """Write `state` (a nested dict that holds "step"; tensors in dicts, the rest JSON) as the
    checkpoint of that step, then DONE, then prune old ones. Every rank of `control` (a
    ControlPlane; None = this process alone) calls it with its own state: each writes its own
    tensors, rank 0 the rest. Returns the checkpoint folder."""
    control = control or ControlPlane()

    def write(folder: str) -> dict[str, dict]:
        return dcp_io.write_tree(folder, state, control)

    step, tree = int(state["step"]), dcp_io.skeleton(state)
    return commit(run, step, tree, write, control, (keep_last, keep_every))


def commit(run: str, step: int, tree: dict, write, control, keep: tuple[int, int]) -> str:
    """The checkpoint protocol around `write(folder)` (every rank's tensors, returning its file
    records): a clean folder, then the tensors, then rank 0 writes state.json (from every rank's
    skeleton `tree`) and DONE once every rank has finished, and prunes."""
    folder = step_dir(run, step)
    if control.rank == 0 and fsio.exists(folder):
        # a leftover of a killed save (or a damaged one): start clean
        fsio.rm(folder, recursive=True)
    control.barrier()
    records = write(folder)
    all_records = control.gather(records)
    # other ranks may hold keys rank 0 has not (their RNG)
    skeletons = control.gather(tree)
    if control.rank == 0:
        tree = skeletons[0]
        for extra in skeletons[1:]:
            tree = dcp_io.merge(tree, extra)
        data = json.dumps(tree).encode()
        fsio.write_bytes(fsio.join(folder, STATE_FILE), data)
        files = {STATE_FILE: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
        for r in all_records:
            files.update(r)
        fsio.write_json(
            fsio.join(folder, "DONE"), {"step": step, "world_size": control.world, "files": files}
        )
        drop_newer(run, step)
        prune(run, *keep)
    control.barrier()  # nobody goes on (or exits) before the marker exists
    return folder


def drop_newer(run: str, step: int) -> None:
    """Delete checkpoints newer than `step`, the one just written. They belong to a timeline this
    run did not resume from: resume takes the newest intact checkpoint, so a newer one was damaged
    (or unreadable). Kept, it would count towards keep_last and push out the intact ones."""
    for s, d in _all_steps(run):
        if s > step:
            log.warning(
                "deleting %s: newer than the checkpoint just written (step %d), so it was not "
                "resumed from (damaged or unreadable)",
                d,
                step,
            )
            fsio.rm(d, recursive=True)


def prune(run: str, keep_last: int, keep_every: int = 0) -> None:  # noqa: D401 - see the module docstring
    """Delete complete checkpoints beyond the last `keep_last` (except multiples of keep_every), and
    incomplete folders older than the newest complete one (leftovers of a killed save)."""
    complete = complete_steps(run)
    if not complete:
        return
    keep = set(complete[-max(1, keep_last) :])
    if keep_every > 0:
        keep |= {s for s in complete if s % keep_every == 0}
    for s, d in _all_steps(run):
        done = s in complete
        if (done and s not in keep) or (not done and s < complete[-1]):
            fsio.rm(d, recursive=True)


FAULT_ENV = "CODEX_TEST_FAIL_CKPT_READ_RANK"  # tests: this RANK cannot read the newest checkpoint


def _injected_fault(folder: str) -> None:
    rank = os.environ.get(FAULT_ENV)
    if rank is not None and rank == os.environ.get("RANK", "0"):
        run_ckpts = os.path.dirname(folder.rstrip("/"))
        newest = max(
            (s for s, d in _all_steps_in(run_ckpts) if fsio.exists(fsio.join(d, "DONE"))),
            default=None,
        )
        if newest is not None and folder.rstrip("/").endswith(f"step_{newest:08d}"):
            raise OSError(f"{folder}: injected read fault on rank {rank} ({FAULT_ENV})")


def _damage(folder: str, rank: int, world: int) -> str | None:
    """What is damaged in this rank's share (every world-th file) of a complete checkpoint, or None.
    A file that is missing, has another size or another sha256 than DONE recorded is damage; any
    other OSError (a storage hiccup) is raised."""
    _injected_fault(folder)
    try:
        done = fsio.read_json(fsio.join(folder, "DONE"))
    except ValueError as e:
        return f"{folder}/DONE: not JSON ({e})"
    if not isinstance(done, dict):
        return f"{folder}/DONE: not a JSON object ({type(done).__name__})"
    files = done.get("files")
    if not isinstance(files, dict):
        return (
            f"{folder}: a single-file checkpoint of an older codex (no file list in DONE); "
            "this version reads only distributed (DCP) checkpoints: start a new --run"
        )
    for name in sorted(files)[rank::world]:
        path, want = fsio.join(folder, name), files[name]
        if not (isinstance(want, dict) and {"bytes", "sha256"} <= set(want)):
            return f"{folder}/DONE: its entry for {name} has no 'bytes' and 'sha256'"
        try:
            actual = fsio.size(path)
            if actual != want["bytes"]:
                return (
                    f"{path}: {actual} bytes, DONE says {want['bytes']} (truncated or overwritten)"
                )
            if fsio.file_sha256(path) != want["sha256"]:
                return f"{path}: its sha256 is not the one DONE recorded (overwritten or corrupt)"
        except FileNotFoundError:
            return f"{path}: missing (DONE lists it)"
    return None


READ_RETRIES = (1.0, 4.0)  # seconds to wait before the 2nd and 3rd try of an I/O error


def damage(folder: str, rank: int = 0, world: int = 1) -> str | None:
    """_damage, with an I/O error (a storage hiccup, not a damaged file) retried and then raised: a
    fallback to an older checkpoint would make the next save delete this intact newer one
    (drop_newer), so a checkpoint that cannot be read right now is an error, not damage."""
    for wait in (*READ_RETRIES, None):
        try:
            return _damage(folder, rank, world)
        except OSError as e:
            if wait is None:
                raise OSError(
                    f"{folder}: could not read the newest checkpoint ({e}); not falling back to an "
                    "older one (that would discard this one): fix the storage error and rerun"
                ) from e
            log.warning("reading %s failed (%s); retrying in %.0f s", folder, e, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def newest_intact(run: str) -> int:
    """The newest complete checkpoint step whose files are all intact (one process checks them
    all); a damaged newer one is skipped with a warning. FileNotFoundError when there is none,
    ValueError when every one is damaged."""
    errors: list[str] = []
    for s in reversed(complete_steps(run)):
        problem = damage(step_dir(run, s))
        if problem is None:
            if errors:
                log.warning("using %s instead of the newest checkpoint", step_dir(run, s))
            return s
        log.warning(
            "checkpoint %s is damaged (%s); trying the previous one", step_dir(run, s), problem
        )
        errors.append(problem)
    if errors:  # bad data (exit 1), not a missing input
        raise ValueError(
            f"no intact checkpoint under {rundir.checkpoints_dir(run)}: every complete one is "
            f"damaged ({'; '.join(errors)})"
        )
    raise FileNotFoundError(f"no intact checkpoint under {rundir.checkpoints_dir(run)} (none yet)")


def read_skeleton(folder: str) -> dict:
    """state.json: the checkpoint's tree, tensors as {"__tensor__": shape, "dtype"}
    (train/checkpoint/dcp.py)."""
    return fsio.read_json(fsio.join(folder, STATE_FILE))


def load(run: str, step: int | str = "latest", keys: tuple[str, ...] | None = None) -> dict:
    """The checkpoint at `step` (or the newest intact one for "latest") as one plain dict of full
    CPU tensors, in this process alone, whatever layout and world size wrote it. `keys`: load only
    these top-level tensor subtrees (e.g. ("model",) for eval); the non-tensor values always come.

    "latest" skips (with a warning) a newest checkpoint with a damaged file and uses the one
    before; an explicit step that is damaged is an error. FileNotFoundError when none."""
    if step == "latest":
        step = newest_intact(run)
    else:
        step = int(step)
        folder = step_dir(run, step)
        if not fsio.exists(fsio.join(folder, "DONE")):
            raise FileNotFoundError(
                f"{folder}: no complete checkpoint (have steps: {complete_steps(run) or 'none'})"
            )
        problem = damage(folder)
        if problem is not None:
            raise ValueError(f"{folder}: not a readable checkpoint ({problem})")
    folder = step_dir(run, step)
    tree = read_skeleton(folder)
    if keys is not None:
        tree = {k: v for k, v in tree.items() if k in keys or not _holds_tensors(v)}
    state = dcp_io.targets_from_skeleton(tree)
    dcp_io.read_tensors(folder, state)
    return state


def _holds_tensors(tree) -> bool:
    if dcp_io.is_tensor_leaf(tree):
        return True
    return isinstance(tree, dict) and any(_holds_tensors(v) for v in tree.values())


def rng_state() -> dict:
    """RNG states as tensors (weights_only-loadable): torch CPU, and every CUDA device's."""
    state: dict = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # tensors in dicts
        state["cuda"] = {str(i): t for i, t in enumerate(torch.cuda.get_rng_state_all())}
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([state["cuda"][k] for k in sorted(state["cuda"], key=int)])
