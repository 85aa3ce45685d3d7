"""`codex data upload LOCAL_RUN gs://bucket/run`: copy a run directory and verify every object.

Each file is uploaded atomically (fsio.upload: a temp object, then a move), so an interrupted upload
never leaves a partial object under a final name. Afterwards every object's size and checksum are
compared with the local file: the MD5 the object store reports (GCS `md5Hash`) when it has one, else
the object is read back and hashed (sha256). A rerun skips objects that already match, so it
resumes an interrupted upload, and re-uploads any that differ (corrupt, truncated, stale).

Commit markers (manifest.json, DONE, stats.json, tokenizer_meta.json, clean's markers/) are
uploaded after everything else, so a reader of the remote run never sees a marker before the data
it vouches for.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import re
from typing import Any

from codex.core import fsio
from codex.core.config import ConfigError
from codex.core.progress import Progress

log = logging.getLogger("codex.upload")

MARKER_NAMES = {"manifest.json", "DONE", "stats.json", "tokenizer_meta.json"}
# fsio.atomic_open's temp files, local and remote
TEMP_NAME = re.compile(r"(^\.tmp-)|(\.tmp-[0-9a-f]{8}$)")


def _local_files(root: str) -> list[str]:
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if TEMP_NAME.search(name):
                continue  # a killed local write; never part of the run
            if name.startswith(".codex-lock"):
                # the local run's lock (codex/core/runlock.py), not data; the remote has its own
                continue
            rels.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    # markers last, so the remote copy only ever shows a marker once its data is there
    return sorted(rels, key=lambda r: (_is_marker(r), r))


def _is_marker(rel: str) -> bool:
    parts = rel.split("/")
    return parts[-1] in MARKER_NAMES or (len(parts) > 1 and parts[-2] == "markers")


def _local_digests(path: str) -> tuple[str, str]:
    """(md5 base64 as GCS reports it, sha256 hex) of a local file."""
    md5, sha = fsio.file_digests(path, "md5", "sha256")
    return base64.b64encode(md5.digest()).decode(), sha.hexdigest()


def _remote_matches(remote_path: str, size: int, md5_b64: str, sha_hex: str) -> tuple[bool, str]:
    """Whether the object exists with this size and checksum; (match, method used)."""
    fs, p = fsio.filesystem(remote_path)
    fs.invalidate_cache(p)
    try:
        info = fs.info(p)
    except FileNotFoundError:
        return False, "missing"
    if int(info.get("size", -1)) != size:
        return False, "size"
    if info.get("md5Hash"):
        return info["md5Hash"] == md5_b64, "md5"
    # No server-side checksum (other stores, composite objects): read it back.
    return fsio.file_sha256(remote_path) == sha_hex, "sha256-readback"


def _remove_stale_temps(remote: str) -> int:
    fs, p = fsio.filesystem(remote)
    if not fs.exists(p):
        return 0
    stale = [f for f in fs.find(p) if TEMP_NAME.search(fsio.basename(f))]
    for f in stale:
        fs.rm(f)
    return len(stale)


# The files that say which run a folder holds: a target whose copy of one differs holds another run
IDENTITY = ("clean/stats.json", "tokenizer/tokenizer_meta.json", "shards/manifest.json")


# The trained model's config: two runs on the same data are still two runs when their models
# differ. Only its `model` section counts, so the same run resumed with more steps uploads again.
TRAIN_CONFIG = "checkpoints/config.yaml"


def _model_section(text: str) -> dict:
    import yaml

    return (yaml.safe_load(text) or {}).get("model", {})


def _another_run(local_run: str, remote: str) -> str:
    """Why `remote` holds another run than `local_run` ("" when it holds none, or this one): one of
    its identity files differs from ours, its trained model's config differs, or it has one we do
    not (a later stage of another run)."""
    dst = fsio.join(remote, TRAIN_CONFIG)
    if fsio.exists(dst):
        src = os.path.join(local_run, TRAIN_CONFIG)
        if not os.path.exists(src):
            return f"it has {TRAIN_CONFIG} (a trained model) and {local_run} has none"
        with open(src) as fh:
            ours, theirs = _model_section(fh.read()), _model_section(fsio.read_text(dst))
        if ours != theirs:
            diff = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
            return f"its {TRAIN_CONFIG} trains another model (model.{', model.'.join(diff)})"
    for rel in IDENTITY:
        dst = fsio.join(remote, rel)
        if not fsio.exists(dst):
            continue
        src = os.path.join(local_run, rel)
        if not os.path.exists(src):
            return f"it has {rel} and {local_run} has none"
        with open(src, "rb") as fh:
            if fsio.read_bytes(dst) != fh.read():
                return f"its {rel} differs from {src}"
    return ""


def _clear(remote: str) -> None:
    """Delete every file under `remote` but the run lock this upload holds there."""
    fs, p = fsio.filesystem(remote)
    for name in fs.find(p):
        if not fsio.basename(name).startswith(".codex-lock"):
            fs.rm(name)
    fs.invalidate_cache()


def upload_run(local_run: str, remote: str, overwrite: bool = False) -> dict:
    """Copy every file under local_run to remote (any fsspec URL), verifying size + checksum of each
    object after upload. Returns counts; raises naming the objects that still differ. A target that
    holds another run is refused (a mix of two runs resumes wrongly) unless `overwrite`, which
    removes what it holds first."""
    if fsio.is_remote(local_run):
        raise ConfigError(f"upload: {local_run} must be a local directory (the source of the copy)")
    if not os.path.isdir(local_run):
        raise FileNotFoundError(f"upload: {local_run} is not a directory")
    files = _local_files(local_run)
    if not files:
        raise ConfigError(f"upload: {local_run} holds no files")
    other = _another_run(local_run, remote)
    if other and not overwrite:
        raise ConfigError(
            f"upload: {remote} holds another run ({other}); upload to another target, or pass "
            "--overwrite to delete what it holds first"
        )
    if other:
        log.warning(
            "upload: %s holds another run (%s); deleting it first (--overwrite)", remote, other
        )
        _clear(remote)
    stale = _remove_stale_temps(remote)
    if stale:
        log.info("upload: removed %d temp object(s) left by an interrupted upload", stale)
    result: dict[str, Any] = {
        "files": len(files),
        "uploaded": 0,
        "skipped": 0,
        "bytes_uploaded": 0,
        "verified": 0,
        "checksum": set(),
        "remote": remote,
    }
    failed = []
    total = sum(os.path.getsize(os.path.join(local_run, r)) for r in files)
    with Progress("upload", total=len(files), unit="files") as prog:
        for rel in files:
            src, dst = os.path.join(local_run, rel), fsio.join(remote, rel)
            size = os.path.getsize(src)
            md5_b64, sha_hex = _local_digests(src)
            ok, method = _remote_matches(dst, size, md5_b64, sha_hex)
            if ok:
                result["skipped"] += 1
            else:
                # a mismatch after upload (rare: corruption in transit) is retried
                for _attempt in range(3):
                    fsio.with_retries(functools.partial(fsio.upload, src, dst), dst)
                    ok, method = _remote_matches(dst, size, md5_b64, sha_hex)
                    if ok:
                        break
                    log.warning(
                        "upload: %s does not match %s after upload (%s); retrying", dst, src, method
                    )
                result["uploaded"] += 1
                result["bytes_uploaded"] += size
            if ok:
                result["verified"] += 1
                result["checksum"].add(method)
            else:
                failed.append(f"{dst} ({method} differs from {src})")
            prog.update(1, bytes=size)
    result["checksum"] = sorted(result["checksum"])
    result["bytes"] = total
    if failed:
        raise RuntimeError(
            f"upload: {len(failed)} object(s) do not match their local file after 3 attempts: "
            + "; ".join(failed[:5])
        )
    log.info(
        "upload: %d files (%d uploaded, %d already there), %.1f MB, all verified (%s) -> %s",
        result["files"],
        result["uploaded"],
        result["skipped"],
        total / 1e6,
        ", ".join(result["checksum"]),
        remote,
    )
    return result
