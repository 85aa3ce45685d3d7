"""The shard folder's files: names, manifest.json (the commit marker), the settings of a started run
and the intermediate files of an unfinished one.

shard_progress.json (the settings) is written before anything else and kept, so a rerun with other
settings is refused even while the manifest is absent. .units/ holds what an unfinished run has
done: each encode unit's token streams and marker, each shard's manifest entries. manifest.json,
written last, lists every shard; train/data/loader.py reads its entries and
pipeline/shard/verify.py checks them. docs/stages.md, "The shard folder", has the layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TypeVar

from codex.core import fsio

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "shard_progress.json"  # {"settings": ...} of a started run (see above)
UNITS = ".units"  # intermediate files of an unfinished run (see above)
UNIT_DONE = "done.json"  # a part's marker inside its folder of .units/
SHARD_MARKERS = "shards"  # the folder of .units/ holding the shards' markers
SPLITS = ("train", "val")

T = TypeVar("T")

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


def file_matches(path: str, sha256: str) -> bool:
    """The file exists and has this sha256."""
    return fsio.exists(path) and fsio.file_sha256(path) == sha256


def remove_temp_files(out: str) -> None:
    """Temp files of a killed write (never under a final name): remove them."""
    for p in fsio.listdir(out):
        name = fsio.basename(p)
        if name.startswith(".tmp-") or re.search(r"\.tmp-[0-9a-f]{8}$", name):
            fsio.rm(p)


def existing_state(out: str) -> dict | None:
    """What an output folder was made with: {"settings": ...} of the progress file, else of the
    manifest, else None."""
    progress_path, manifest_path = fsio.join(out, PROGRESS), fsio.join(out, MANIFEST)
    if fsio.exists(progress_path):
        return fsio.read_json(progress_path)
    if fsio.exists(manifest_path):
        return {"settings": fsio.read_json(manifest_path).get("settings", {})}
    return None


def build_manifest(
    shards: dict[str, list[list[dict]]], settings: dict, meta: dict, dtype: str, s, docs: dict
) -> dict:
    """The manifest of every split's shards (shards[split][k] = shard k's entries, one per
    format), checked against the corpus's document counts."""
    entries, totals = [], {}
    for sp in SPLITS:
        groups = shards[sp]
        for g in groups:
            entries += g
        first = [g[0] for g in groups]
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
        "shards": entries,
        "totals": totals,
        "settings": settings,
    }


# Under this many validation tokens a loss measured on them moves by hundredths of a nat from
# noise alone; the suggested val_fraction stops at VAL_FRACTION_CAP, as a small corpus cannot spare
# more of its training text.
VAL_TOKENS_FLOOR = 1 << 16
VAL_FRACTION_CAP = 0.1


def small_val_split(manifest: dict, shards_dir: str) -> str | None:
    """One line when the manifest's validation split holds fewer than VAL_TOKENS_FLOOR tokens and
    a larger val_fraction (up to VAL_FRACTION_CAP) would give it more: how many it holds and the
    val_fraction that would hold about the floor. None otherwise (or without totals)."""
    val = (manifest.get("totals") or {}).get("val", {}).get("tokens")
    fraction = float(manifest.get("val_fraction") or 0)
    if val is None or val >= VAL_TOKENS_FLOOR or not 0 < fraction < VAL_FRACTION_CAP:
        return None
    want = min(VAL_FRACTION_CAP, fraction * VAL_TOKENS_FLOOR / max(val, 1))
    digits = 1 - math.floor(math.log10(want))  # rounded up to two significant digits
    want = min(VAL_FRACTION_CAP, math.ceil(want * 10**digits) / 10**digits)
    return (
        f"{shards_dir}: the validation split holds {val:,} tokens, under {VAL_TOKENS_FLOOR:,}: "
        "its loss and bits per byte move with noise; for about "
        f"{round(val * want / fraction):,}, remove {shards_dir} and rerun `codex data shard` "
        f"with --val-fraction {want:g} (now {fraction:g})"
    )


def per_path(fn: Callable[[str], T], paths: list[str]) -> list[T]:
    """fn of each path, in order: 16 at a time on an object store, where each is a request (a
    part's size, its parquet footer, a marker), so a planning step that asks something of every
    object costs a sixteenth of the round trips; one after another on a local disk."""
    return fsio.map_requests(fn, paths, fsio.request_threads(paths))


def read_markers(paths: list[str]) -> list[dict | None]:
    """The JSON of each path (None for one that is unreadable), read concurrently on an object
    store, where each is a request."""

    def read(path: str) -> dict | None:
        try:
            m = fsio.read_json(path)
        except (ValueError, FileNotFoundError):
            return None
        return m if isinstance(m, dict) else None

    return per_path(read, paths)
