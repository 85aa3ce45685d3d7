"""The shard folder's files: names, manifest.json (the commit marker) and shard_progress.json
(resume).

    RUN/shards/train_00000.npy ...   shards, each written atomically
    RUN/shards/shard_progress.json   after each shard: its entry + where the next shard of its split
                                     starts in the corpus; kept after the manifest so a damaged
                                     shard can be redone
    RUN/shards/manifest.json         last: every shard's entry (split, path, format, tokens,
                                     documents, sha256), totals, and the settings they were
                                     made with

A manifest entry is what train/data/loader.py reads and pipeline/shard/verify.py checks.
"""

from __future__ import annotations

import logging
import re

from codex import fsio

log = logging.getLogger("codex.shard")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# resume state; kept after the manifest so a damaged shard can be redone
PROGRESS = "shard_progress.json"
SPLITS = ("train", "val")

SHARD_NAME = re.compile(r"(train|val)_\d{5,}\.(npy|parquet)")


def shard_name(split: str, index: int, fmt: str) -> str:
    return f"{split}_{index:05d}.{fmt}"


def shard_entry(split: str, name: str, fmt: str, tokens: int, documents: int, sha256: str) -> dict:
    """One manifest entry: a shard file of `tokens` tokens holding `documents` <|bos|> tokens."""
    return {
        "split": split,
        "path": name,
        "format": fmt,
        "tokens": int(tokens),
        "documents": int(documents),
        "sha256": sha256,
    }


def mismatch(old: dict, new: dict) -> list[str]:
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in new if old.get(k) != new.get(k)]


def good_prefix(out: str, entries: list[dict]) -> int:
    """How many recorded shards (groups of entries with one index) still match their sha256."""
    good = 0
    for group in entries:
        for e in group["files"]:
            try:  # the progress file is read back like a manifest: its paths stay inside `out`
                p = fsio.join_inside(out, e["path"], f"{fsio.join(out, PROGRESS)}: a shard path")
            except ValueError as err:
                log.warning("shard: %s; redoing it and the rest of its split", err)
                return good
            if not fsio.exists(p) or fsio.file_sha256(p) != e["sha256"]:
                log.warning(
                    "shard: %s is missing or changed; redoing it and the rest of its split", p
                )
                return good
        good += 1
    return good


def remove_temp_files(out: str) -> None:
    """Temp files of a killed write (never under a final name): remove them."""
    for p in fsio.listdir(out):
        name = fsio.basename(p)
        if name.startswith(".tmp-") or re.search(r"\.tmp-[0-9a-f]{8}$", name):
            fsio.rm(p)


def existing_state(out: str) -> dict | None:
    """What an output folder already holds: the progress file (resume state), else {"settings"} of
    the manifest, else None."""
    progress_path, manifest_path = fsio.join(out, PROGRESS), fsio.join(out, MANIFEST)
    if fsio.exists(progress_path):
        return fsio.read_json(progress_path)
    if fsio.exists(manifest_path):
        return {"settings": fsio.read_json(manifest_path).get("settings", {})}
    return None


def build_manifest(state: dict, meta: dict, dtype: str, s, docs: dict) -> dict:
    shards, totals = [], {}
    for sp in SPLITS:
        groups = state["splits"][sp]
        for g in groups:
            shards += g["files"]
        first = [g["files"][0] for g in groups]
        totals[sp] = {
            "tokens": sum(e["tokens"] for e in first),
            "documents": sum(e["documents"] for e in first),
            "shards": len(groups),
        }
        if totals[sp]["documents"] != docs[sp]:  # each document's <|bos|> sits in exactly one shard
            raise RuntimeError(
                f"shard: {sp} shards hold {totals[sp]['documents']} documents, corpus has "
                f"{docs[sp]}: internal error, please report"
            )
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": {"sha256": meta["sha256"], "vocab_size": meta["vocab_size"]},
        "special_ids": dict(meta["special_ids"]),
        "dtype": dtype,
        "append_eos": s.append_eos,
        "val_fraction": s.val_fraction,
        "shard_tokens": s.shard_tokens,
        "shards": shards,
        "totals": totals,
        "settings": state["settings"],
    }
