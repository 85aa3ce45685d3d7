"""clean's plan: the input files, the units of work they are cut into (plan_units), the
fingerprint of what the units write, and the markers of the units an earlier run finished.

The plan depends only on the inputs and settings, never on --workers or the executor, so a rerun
with other workers resumes the same units (docs/stages.md, "clean").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from codex.core import fsio
from codex.core.config import ConfigError
from codex.pipeline.clean.filters import active_filters
from codex.pipeline.clean.pack import packed_units
from codex.pipeline.clean.parts import hash_path, marker_path
from codex.pipeline.inputs import clean_inputs, ls_matching
from codex.pipeline.readers import (
    BadInputFile,
    InputFile,
    Piece,
    parquet_row_groups,
    splittable,
)
from codex.pipeline.stage import Stage

log = logging.getLogger("codex.clean")

# Settings that change what is written (part of the plan fingerprint); others (workers,
# task_index) only change how it is computed.
# skip_unreadable_links: a rerun that skips the links which failed redoes only their units.
_RUNTIME_KEYS = (
    "workers",
    "task_index",
    "min_yield",
    "min_source_yield",
    "allow_low_yield",
    "skip_unreadable_links",
)


@dataclass
class Unit:
    index: int
    pieces: list[Piece]

    @property
    def name(self) -> str:
        return f"{self.index:06d}"


def _bounds(size: int, chunk_bytes: int, fine_from: int) -> list[int]:
    """Byte offsets that cut [0, size) into pieces of about chunk_bytes, and of 1/TAIL_SPLIT of
    that from fine_from on (0 and size included)."""
    head = min(max(fine_from, 0), size)
    bounds = {0, head, size}
    for a, b, chunk in ((0, head, chunk_bytes), (head, size, max(1, chunk_bytes // TAIL_SPLIT))):
        n = -(-(b - a) // chunk)
        bounds.update(a + k * (b - a) // n for k in range(1, n))
    return sorted(bounds)


def _split_file(f: InputFile, bounds: list[int], groups: list[tuple[int, int]]) -> list[Piece]:
    """A splittable file in pieces between these byte offsets (_bounds; a parquet file's at the
    row groups nearest them: `groups`, its parquet_row_groups)."""
    if f.kind != "parquet":
        return [Piece(f, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    if len(groups) < 2:
        return [Piece(f)]
    # cut before the row group where each bound's share of the (uncompressed) bytes begins
    sizes = np.cumsum([b for _, b in groups])
    goals = [sizes[-1] * x / f.size for x in bounds[1:-1]]
    cuts = sorted({int(np.searchsorted(sizes, g, side="right")) for g in goals})
    cuts = [c for c in cuts if 0 < c < len(groups)]
    rows = [0, *cuts, len(groups)]
    return [Piece(f, a, b) for a, b in zip(rows, rows[1:], strict=False)]


# Requests the driver has in flight at once for per-object metadata (parquet footers while it
# plans, unit markers on a rerun): on an object store each is a round trip of tens of ms, so
# 125,000 of them one after another would take an hour.
METADATA_THREADS = 64


# Units start in their list's order (executor.py: _run_pool, _run_ray), so the small ones go last:
# the corpus's last TAIL_CHUNKS x chunk_bytes go in units 1/TAIL_SPLIT that size, and the workers
# run out of work together instead of one finishing a big unit while the others idle.
TAIL_CHUNKS = 2
TAIL_SPLIT = 4


def plan_units(files: list[InputFile], c) -> list[Unit]:
    """Units of about chunk_bytes of input (less in the tail: TAIL_CHUNKS), in corpus
    order (files sorted, pieces in order). The plan depends on the files and settings only, never
    on the workers: a rerun with other workers resumes the same units."""
    units: list[Unit] = []
    pack: list[Piece] = []
    size = 0
    fine_from = sum(f.size for f in files) - TAIL_CHUNKS * c.chunk_bytes  # in the corpus's bytes
    cuts = []  # per file: its bounds, and whether it is cut at them
    for f in files:
        bounds = _bounds(f.size, c.chunk_bytes, fine_from)
        fine_from -= f.size  # from here on: in the next file's bytes
        cuts.append((bounds, len(bounds) > 2 and splittable(f, f.delimiter(c))))
    # the footers of the parquet files to cut, read side by side
    footers = [
        f.path for f, (_, cut) in zip(files, cuts, strict=True) if cut and f.kind == "parquet"
    ]
    groups = dict(
        zip(footers, fsio.map_requests(parquet_row_groups, footers, METADATA_THREADS), strict=True)
    )
    for f, (bounds, cut) in zip(files, cuts, strict=True):
        pieces = _split_file(f, bounds, groups.get(f.path, [])) if cut else []
        if len(pieces) > 1:
            if pack:
                units.append(Unit(len(units), pack))
                pack, size = [], 0
            units += [Unit(len(units) + k, [piece]) for k, piece in enumerate(pieces)]
            continue
        if f.size > c.chunk_bytes and not cut:
            log.info(
                "clean: %s (%.0f MB) is one unit: %s",
                f.path,
                f.size / 1e6,
                "a compressed stream cannot be split (split big files before compressing them)"
                if f.kind == "jsonl"
                else "an undelimited text file is one document",
            )
        if pack and size + f.size > c.chunk_bytes:
            units.append(Unit(len(units), pack))
            pack, size = [], 0
        pack.append(Piece(f))
        size += f.size
    if pack:
        units.append(Unit(len(units), pack))
    return units


def plan_fingerprint(c, files: list[InputFile], eval_sets: str = "") -> str:
    """What the units write depends on: the settings that change it, the input files and the
    content of decontam's eval sets (eval_sets: their fingerprint, decontam.read_eval_sets)."""
    settings = {k: v for k, v in dataclasses.asdict(c).items() if k not in _RUNTIME_KEYS}
    for name in ("decontam", "lang", "classifier"):
        if not getattr(c, name).enabled:  # off: the fingerprint of a run from before it existed
            del settings[name]
    # a source's allow_low_yield is a runtime key too: allowing it redoes no unit
    settings["sources"] = [
        {k: v for k, v in s.items() if k != "allow_low_yield"} if isinstance(s, dict) else s
        for s in settings["sources"]
    ]
    listed = [
        (f.path, f.size, f.preset, f.txt_delimiter) + ((f.not_read,) if f.not_read else ())
        for f in files
    ]
    blob = json.dumps(
        {"settings": settings, "files": listed, **({"eval_sets": eval_sets} if eval_sets else {})},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def inputs_and_filters(c) -> tuple[list, list, list[str]]:
    """(the input files, the skipped ones, every filter any input runs, in order)."""
    try:
        files, skipped = clean_inputs(c)
    except BadInputFile as e:
        raise ConfigError(str(e)) from None
    if not files:
        raise ConfigError(
            f"no input files of a supported type in {c.inputs} (skipped {len(skipped)})"
        )
    filters: list[str] = []
    for preset in sorted({f.preset for f in files}):
        filters += [n for n in active_filters(c, preset) if n not in filters]
    return files, skipped, filters


def drop_markers_without_files(
    out: str, markers: dict[str, dict], dedup: bool
) -> tuple[set[str], list[str]]:
    """A marker vouches for the files it lists: a unit whose part or hash file is gone (deleted by
    hand, lost in a copy) loses its marker here and is cleaned again, instead of every later step
    failing on the missing file. A unit whose parts were packed (pack_groups) and deleted keeps
    its marker. One listing of each folder, whatever the number of units. Returns the units whose
    parts were packed and deleted, and the packed units' parts still there (a deletion that was
    interrupted)."""
    parts = {fsio.basename(p) for p in ls_matching(out, "part-*.parquet")}
    packed = packed_units(parts)
    packed_away: set[str] = set()
    leftover: list[str] = []
    hashes = {fsio.basename(p) for p in ls_matching(fsio.join(out, "hashes"), "*.npy")}
    signed = set()  # data.clean.near_dedup's files
    if any("near_dedup" in m for m in markers.values()):
        signed = {fsio.basename(p) for p in ls_matching(fsio.join(out, "minhash"), "*.npy")}
    for name, m in list(markers.items()):
        missing = [p for p in m["shards"] if p not in parts]
        if name in packed:
            leftover += [p for p in m["shards"] if p in parts]
            packed_away.update([name] if missing else [])
            missing = []
        if dedup and fsio.basename(hash_path(out, name)) not in hashes:
            missing.append(f"hashes/{name}.npy")
        if "near_dedup" in m:
            missing += [
                f"minhash/{f}" for f in (f"{name}.npy", f"{name}-index.npy") if f not in signed
            ]
        if missing:
            log.warning(
                "clean: unit %s's marker lists %s, which %s missing: cleaning the unit again",
                name,
                ", ".join(missing[:3]),
                "is" if len(missing) == 1 else "are",
            )
            fsio.rm(marker_path(out, name))
            del markers[name]
    return packed_away, leftover


def read_markers(stage: Stage, fingerprint: str) -> dict[str, dict]:
    """Every unit marker in the folder (one listing, the reads side by side: fsio.map_requests),
    refused when one was written for other inputs or settings."""
    paths = ls_matching(fsio.join(stage.out, "markers"), "*.json")
    markers = {}
    for path, m in zip(
        paths, fsio.map_requests(_read_marker, paths, METADATA_THREADS), strict=True
    ):
        if m.get("fingerprint") != fingerprint:
            stage.refuse(
                f"holds output cleaned from other inputs or settings ({path})",
                f"use another --run or delete {stage.out}",
            )
        markers[m["unit"]] = m
    return markers


def _read_marker(path: str) -> Any:
    return held(fsio.read_json(path))


# what a marker records for people (what the unit read): the driver does not keep it
_NOT_HELD = ("pieces",)
# the keys the driver reads of every unit in the middle of a run, kept as they are
_HOT = ("unit", "shards", "part_bytes", "failed")
_ABSENT = object()


class Held(Mapping):
    """A unit's marker as the driver keeps it until the end of the run, read as the dict it was
    (less _NOT_HELD): its _HOT keys as they are, the rest (the counts) as compressed JSON, about
    a quarter of the dict, decoded when asked for. The marker decoded last is kept: a pass over
    the markers (stats.py) reads several keys of each in turn. Its per_source, for a unit of one
    source, is that source's name (stats.py: unit_sources)."""

    __slots__ = ("unit", "shards", "part_bytes", "failed", "_rest")
    _last: tuple[Any, Any] = (None, None)  # (the Held decoded last, its dict)

    def __init__(self, marker: dict):
        self.unit = sys.intern(marker["unit"])
        self.shards = marker.get("shards", _ABSENT)
        self.part_bytes = marker.get("part_bytes", _ABSENT)
        self.failed = marker.get("failed", _ABSENT)
        rest = {k: v for k, v in marker.items() if k not in _HOT and k not in _NOT_HELD}
        sources = rest.get("per_source")
        if isinstance(sources, dict) and len(sources) == 1:
            rest["per_source"] = next(iter(sources))
        self._rest = zlib.compress(json.dumps(rest, separators=(",", ":")).encode(), 1)

    def _decoded(self) -> dict:
        last, rest = Held._last
        if last is not self:
            rest = json.loads(zlib.decompress(self._rest))
            Held._last = (self, rest)
        return rest

    def __getitem__(self, key: str):
        if key in _HOT:
            value = getattr(self, key)
            if value is _ABSENT:
                raise KeyError(key)
            return value
        return self._decoded()[key]

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in _HOT if getattr(self, k) is not _ABSENT)
        yield from self._decoded()

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        if key in _HOT:
            return getattr(self, str(key)) is not _ABSENT
        return key in self._decoded()


def held(marker: dict) -> Any:
    """A unit's marker as the driver keeps it (Held: read as a dict, never written)."""
    return Held(marker)
