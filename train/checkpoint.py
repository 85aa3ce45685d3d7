"""Checkpoints: RUN/checkpoints/step_NNNNNNNN/ckpt.pt, then DONE written last (local or gs://).

ckpt.pt is one torch.save dict that loads with torch.load(weights_only=True): only tensors,
dicts, lists, numbers and strings. So the config is a plain dict, RNG states are uint8 tensors
and the loader state is {"epoch", "position"}:

    {"model", "optimizer", "step", "tokens", "loader", "rng", "config", "codex_version", ...}

The training state is built and put back here (`save_training` / `restore_training`), so the loop
never touches the dict's keys.

A checkpoint counts only once DONE exists; DONE records ckpt.pt's size, so a truncated file is
detected before unpickling. load(run, "latest") walks back from the newest complete checkpoint
and skips any that is truncated or unreadable, saying so. Retention: the last `keep_last`, plus
every step that is a multiple of `keep_every` (when > 0), the rest is deleted after a save.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import tempfile
import time

import torch

import codex
from codex import fsio, rundir
from codex.config import ConfigError, to_dict
from train.optim import load_optimizer_state

log = logging.getLogger("codex.checkpoint")

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


def save(run: str, state: dict, keep_last: int = 3, keep_every: int = 0) -> str:
    """Write `state` (must hold "step") as a checkpoint, then DONE, then prune old ones. Call on
    one process only (rank 0). Returns the checkpoint folder."""
    step = int(state["step"])
    folder = step_dir(run, step)
    path = fsio.join(folder, "ckpt.pt")
    fsio.makedirs(folder)
    if fsio.is_remote(run):
        # Serialise locally, then upload (temp object + move in fsio.upload): torch.save wants
        # a seekable file and a crash mid-upload must leave no partial ckpt.pt.
        fd, tmp = tempfile.mkstemp(suffix=".pt")
        os.close(fd)
        try:
            torch.save(state, tmp)
            nbytes = os.path.getsize(tmp)
            fsio.upload(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    else:
        with fsio.atomic_open(path, "wb") as f:
            torch.save(state, f)
        nbytes = fsio.size(path)
    fsio.write_json(fsio.join(folder, "DONE"), {"step": step, "bytes": nbytes})
    drop_newer(run, step)
    prune(run, keep_last, keep_every)
    return folder


def drop_newer(run: str, step: int) -> None:
    """Delete checkpoints newer than `step`, the one just written. They belong to a timeline this
    run did not resume from: resume takes the newest intact checkpoint, so a newer one was damaged
    (or unreadable). Kept, it would count towards keep_last and push out the intact ones."""
    for s, d in _all_steps(run):
        if s > step:
            log.warning("deleting %s: newer than the checkpoint just written (step %d), so it was not resumed "
                        "from (damaged or unreadable)", d, step)
            fsio.rm(d, recursive=True)


def prune(run: str, keep_last: int, keep_every: int = 0) -> None:  # noqa: D401 - see the module docstring
    """Delete complete checkpoints beyond the last `keep_last` (except multiples of keep_every), and
    incomplete folders older than the newest complete one (leftovers of a killed save)."""
    complete = complete_steps(run)
    if not complete:
        return
    keep = set(complete[-max(1, keep_last):])
    if keep_every > 0:
        keep |= {s for s in complete if s % keep_every == 0}
    for s, d in _all_steps(run):
        done = s in complete
        if (done and s not in keep) or (not done and s < complete[-1]):
            fsio.rm(d, recursive=True)


FAULT_ENV = "CODEX_TEST_FAIL_CKPT_READ_RANK"   # tests: this RANK cannot read the newest checkpoint


def _injected_fault(folder: str) -> None:
    rank = os.environ.get(FAULT_ENV)
    if rank is not None and rank == os.environ.get("RANK", "0"):
        run_ckpts = os.path.dirname(folder.rstrip("/"))
        newest = max((s for s, d in _all_steps_in(run_ckpts) if fsio.exists(fsio.join(d, "DONE"))), default=None)
        if newest is not None and folder.rstrip("/").endswith(f"step_{newest:08d}"):
            raise OSError(f"{folder}/ckpt.pt: injected read fault on rank {rank} ({FAULT_ENV})")


def _read(folder: str, map_location) -> dict:
    _injected_fault(folder)
    done = fsio.read_json(fsio.join(folder, "DONE"))
    path = fsio.join(folder, "ckpt.pt")
    actual = fsio.size(path)
    if actual != done.get("bytes", actual):
        raise ValueError(f"{path}: {actual} bytes, DONE says {done['bytes']} (truncated or overwritten)")
    with fsio.open(path, "rb") as f:
        if fsio.is_remote(path):
            f = io.BytesIO(f.read())  # torch.load needs a seekable file
        return torch.load(f, map_location=map_location, weights_only=True)


READ_RETRIES = (1.0, 4.0)   # seconds to wait before the 2nd and 3rd try of an I/O error


def _read_retrying(folder: str, map_location) -> dict:
    """_read, with an I/O error (a storage hiccup, not a damaged file) retried and then raised: a
    fallback to an older checkpoint would make the next save delete this intact newer one
    (drop_newer), so a checkpoint that cannot be read right now is an error, not damage."""
    for wait in (*READ_RETRIES, None):
        try:
            return _read(folder, map_location)
        except FileNotFoundError:
            raise                          # ckpt.pt gone although DONE exists: damaged
        except OSError as e:
            if wait is None:
                raise OSError(f"{folder}: could not read the newest checkpoint ({e}); not falling back to an "
                              "older one (that would discard this one): fix the storage error and rerun") from e
            log.warning("reading %s failed (%s); retrying in %.0f s", folder, e, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def load(run: str, step: int | str = "latest", map_location="cpu") -> dict:
    """The checkpoint dict at `step`, or the newest intact one for "latest".

    "latest" skips (with a warning) a newest checkpoint that is truncated or unreadable and uses
    the one before; an explicit step that is damaged is an error. FileNotFoundError when none.
    """
    ckpt_dir = rundir.checkpoints_dir(run)
    if step != "latest":
        step = int(step)
        folder = step_dir(run, step)
        if not fsio.exists(fsio.join(folder, "DONE")):
            raise FileNotFoundError(f"{folder}: no complete checkpoint (have steps: {complete_steps(run) or 'none'})")
        try:
            return _read(folder, map_location)
        except Exception as e:   # truncated zip, not a torch file, size mismatch: one line, exit 1
            raise ValueError(f"{fsio.join(folder, 'ckpt.pt')}: not a readable checkpoint "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    errors = []
    for s in reversed(complete_steps(run)):
        folder = step_dir(run, s)
        try:
            state = _read_retrying(folder, map_location)
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                raise                      # storage error after retries: not damage, no fallback
            log.warning("checkpoint %s is damaged (%s: %s); trying the previous one", folder, type(e).__name__, e)
            errors.append(f"{folder}: {e}")
            continue
        except Exception as e:  # truncated zip, bad pickle, size mismatch: try the previous one
            log.warning("checkpoint %s is damaged (%s: %s); trying the previous one", folder, type(e).__name__, e)
            errors.append(f"{folder}: {e}")
            continue
        if errors:
            log.warning("resuming from %s instead of the newest checkpoint", folder)
        return state
    detail = ("; damaged: " + "; ".join(errors)) if errors else ""
    raise FileNotFoundError(f"no intact checkpoint under {ckpt_dir}{detail}")


def rng_state() -> dict:
    """RNG states as tensors (weights_only-loadable): torch CPU, and every CUDA device's."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- the whole training state -------------------------------------------------------------------

def save_training(cfg, *, model_state: dict, optimizer, loader, step: int, tokens: int, log_window: dict,
                  world_size: int, batch_tokens: int, tokenizer_sha: str) -> str:
    """Write everything a resumed run needs to continue exactly (rank 0 only); returns the folder."""
    state = {
        "model": model_state, "optimizer": _to_cpu(optimizer.state_dict()),
        "step": step, "tokens": tokens, "loader": loader.state_dict(), "rng": rng_state(),
        "config": to_dict(cfg), "codex_version": codex.__version__,
        "world_size": world_size, "batch_tokens": batch_tokens, "tokenizer_sha256": tokenizer_sha,
        "log_window": log_window,
    }
    return save(cfg.run, state, keep_last=cfg.train.keep_last, keep_every=cfg.train.keep_every)


def restore_training(cfg, state: dict, model, optimizer, loader) -> tuple[int, int, dict]:
    """Load a checkpoint's training state into the model, optimizer, loader and RNGs; returns
    (step, tokens, the unfinished log window). The model must be the one the checkpoint was saved from."""
    saved_model = state["config"].get("model", {})
    for k, v in to_dict(cfg.model).items():
        if k != "preset" and k in saved_model and saved_model[k] != v:   # the preset is a name, not the model
            raise ConfigError(f"model.{k}={v!r} differs from the checkpoint's {saved_model[k]!r} "
                              f"({rundir.checkpoints_dir(cfg.run)}); resume with the same model or use a new --run")
    model.load_state_dict(state["model"])
    load_optimizer_state(optimizer, state["optimizer"])
    loader.load_state_dict(state["loader"])
    set_rng_state(state["rng"])
    step = int(state["step"])
    return step, int(state["tokens"]), state.get("log_window") or {"loss_sum": 0.0, "since": step}


def _to_cpu(obj):
    """Optimizer state with every tensor on the CPU, so a checkpoint loads on any device."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
