"""Packing clean's output: the parts of consecutive units copied into parts of about
data.clean.part_bytes (pack_groups decides the groups, pack_group writes one), so a big corpus
gives later stages a part per ~128 MB instead of one per unit.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from codex.core import fsio
from codex.pipeline.executor import Where, run_units
from codex.pipeline.stage import Stage

log = logging.getLogger("codex.clean")


def pack_groups(markers: list[dict], part_bytes: int) -> list[tuple[int, int]]:
    """Runs [a, b) of consecutive units (markers in corpus order) whose parts hold about
    part_bytes together: a group ends with the unit that brings it to part_bytes (sizes before
    the corpus-wide dedups, so the groups depend on the units alone). A unit each for part_bytes
    0, and for a corpus smaller than one part (its later stages keep a task per unit)."""
    groups, start, size = [], 0, 0
    small = sum(m.get("part_bytes", 0) for m in markers) < part_bytes
    for i, m in enumerate(markers):
        size += m.get("part_bytes", 0)
        if not part_bytes or small or size >= part_bytes:
            groups.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(markers):
        groups.append((start, len(markers)))
    return groups


def packed_name(first: str, last: str) -> str:
    """The part that units first..last (names) are packed into."""
    return f"part-{first}-{last}.parquet"


_PACKED = re.compile(r"part-(\d{6,})-(\d{6,})\.parquet")


def packed_units(names: set[str]) -> set[str]:
    """The units (names) whose parts were packed into one of these parts (file names)."""
    units: set[str] = set()
    for name in names:
        m = _PACKED.fullmatch(name)
        if m:
            width = len(m[1])
            units.update(f"{u:0{width}d}" for u in range(int(m[1]), int(m[2]) + 1))
    return units


@dataclass
class PackJob:
    """One packed part: the parts of a group of units, in corpus order (picklable)."""

    out: str
    name: str
    parts: list[str]
    row_group_size: int


def pack_group(job: PackJob) -> str:
    """Copy the group's parts, rows in order, into one part (atomic), in row groups of
    row_group_size rows; one row group in memory at a time."""
    held: list[pa.Table] = []
    rows = 0
    with fsio.atomic_open(fsio.join(job.out, job.name), "wb") as fh:
        writer: pq.ParquetWriter | None = None
        for part in job.parts:
            with fsio.open(fsio.join(job.out, part), "rb") as src:
                pf = pq.ParquetFile(src)
                if writer is None:
                    writer = pq.ParquetWriter(fh, pf.schema_arrow, compression="zstd")
                for i in range(pf.num_row_groups):
                    held.append(pf.read_row_group(i))
                    rows += held[-1].num_rows
                    if rows >= job.row_group_size:  # whole row groups out, the rest held
                        table = pa.concat_tables(held)
                        cut = rows - rows % job.row_group_size
                        writer.write_table(table.slice(0, cut), row_group_size=job.row_group_size)
                        held, rows = [table.slice(cut)], rows - cut
        assert writer is not None  # a group has parts
        if rows:
            writer.write_table(pa.concat_tables(held), row_group_size=job.row_group_size)
        writer.close()
    return job.name


def pack_parts(stage: Stage, ordered: list[dict], where: Where) -> tuple[list[str], list[str]]:
    """Pack every group of units (pack_groups) of more than one unit into one part; returns the
    corpus's parts in order and the units' parts they replace (deleted once stats.json lists the
    packed ones)."""
    c = stage.cfg.data.clean
    final: list[str] = []
    jobs: list[PackJob] = []
    replaced: list[str] = []
    for a, b in pack_groups(ordered, c.part_bytes):
        parts = [p for m in ordered[a:b] for p in m["shards"]]
        if b - a == 1 or not parts:
            final += parts
            continue
        name = packed_name(ordered[a]["unit"], ordered[b - 1]["unit"])
        final.append(name)
        jobs.append(PackJob(stage.out, name, parts, c.row_group_size))
        replaced += parts
    if jobs:
        for _ in run_units(pack_group, jobs, where):
            pass
        log.info("clean: packed %d parts into %d", len(replaced), len(jobs))
    return final, replaced
