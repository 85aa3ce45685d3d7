"""`codex data clean`: raw text -> normalised, filtered, exactly deduplicated parquet parts.

    files (sorted) --plan--> units of ~chunk_bytes of input: a big file is cut into pieces
                             (byte ranges of .jsonl and delimited text, row groups of .parquet),
                             small files are packed together
    unit --read--> normalize --> filters (preset) --> in-unit dedup
         --> part-UUUUUU-SSS.parquet
           + hashes/UUUUUU.npy (kept documents' hashes, sorted)
           + markers/UUUUUU.json  (last)
    every unit done --> corpus-wide exact dedup, a shuffle (pipeline/clean/dedup.py):
                        one task per hash partition keeps the first copy in corpus order,
                        then each group of units rewrites its parts without the later copies
                    --> config.yaml, stats.json (last)

Units of work: a unit is processed by one worker start to finish (pipeline/executor/: this
process, --workers processes, or Ray tasks) and writes its own parts, so any executor gives
byte-identical output, and a killed run redoes only the units without a marker. The plan depends
only on the inputs and settings (not on --workers or the executor). A job array (num_tasks) is
still possible without Ray: task I takes units I, I+N, ..., and the last task to finish runs the
dedup.

Bad input is counted per file and reported in stats.json and the log; it never stops the run. A
file that cannot be used at all (unreadable, parquet without the text column) is reported as
failed, the other files are cleaned; its unit gets no completion credit (its marker lists the
failure), so a rerun after fixing the file redoes that unit, and run_clean raises at the end so
the job does not look successful.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import sys
import time
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from codex.core import fsio, rundir
from codex.core.config import ConfigError
from codex.core.config.data import CleanConfig
from codex.core.progress import Progress
from codex.pipeline.clean import minhash, near_dedup, words
from codex.pipeline.clean.dedup import dedup_corpus, text_hash
from codex.pipeline.clean.filters import Doc, active_filters, apply_filters, normalize
from codex.pipeline.clean.parts import PartWriter
from codex.pipeline.clean.stats import (
    drop_fix,
    low_yield,
    nothing_kept,
    summarize,
    top_drop,
    whole_files_dropped,
    yield_problem,
)
from codex.pipeline.clean.words import forget_pieces
from codex.pipeline.executor import (
    Where,
    check_executor,
    run_units,
    stage_pool,
    where_for,
    worker_id,
)
from codex.pipeline.inputs import clean_inputs, ls_matching
from codex.pipeline.readers import (
    BadInputFile,
    FileReport,
    InputFile,
    Piece,
    Record,
    parquet_row_groups,
    read_records,
    splittable,
)
from codex.pipeline.stage import Stage

log = logging.getLogger("codex.clean")

# --workers 0: one process per this much input at most; a process's start (spawn, imports) is
# won back only above it (measured: README's stage table)
AUTO_BYTES_PER_WORKER = 8 << 20

# Settings that change what is written (part of the plan fingerprint); others (workers,
# task_index) only change how it is computed.
_RUNTIME_KEYS = ("workers", "task_index", "min_yield", "allow_low_yield")


T = TypeVar("T")
R = TypeVar("R")


class CleanError(RuntimeError):
    """Some input files could not be used; everything else was cleaned (see stats.json)."""


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


# Units start in their list's order (executor/: run_pool, run_ray), so the small ones go last:
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


def _fingerprint(c, files: list[InputFile]) -> str:
    settings = {k: v for k, v in dataclasses.asdict(c).items() if k not in _RUNTIME_KEYS}
    listed = [(f.path, f.size, f.preset, f.txt_delimiter) for f in files]
    blob = json.dumps({"settings": settings, "files": listed}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# one unit (runs in a worker: this process, a pool process or a Ray task)


@dataclass
class UnitJob:
    """What a worker needs to clean one unit (picklable)."""

    unit: Unit
    c: CleanConfig
    out: str
    filters: list[str]
    fingerprint: str


def _sweep_temp_files(out: str) -> int:
    """Remove the temp files of writes a killed run left anywhere in the clean folder (its parts,
    hash files, markers, dedup files, stats). Only for a run that is the folder's one writer: the
    tasks of a job array write it together."""
    gone = 0
    for sub in ("", "rejected", "hashes", "markers", "dedup", "minhash", "near"):
        for path in ls_matching(fsio.join(out, sub) if sub else out, ".tmp-*"):
            fsio.rm(path)
            gone += 1
    return gone


def _numbered(folder: str, prefix: str, suffix: str = ".parquet") -> list[str]:
    """The files folder/PREFIX-000SUFFIX, -001, ... that exist, probed by exact name up to the
    first missing one: a PartWriter writes them in order, and they are removed last first
    (_remove_unit_outputs), so what exists is always such a run from 000. One request a file
    (plus one), never a listing of the folder: that holds every unit's files."""
    found: list[str] = []
    while fsio.exists(path := fsio.join(folder, f"{prefix}-{len(found):03d}{suffix}")):
        found.append(path)
    return found


def _remove_unit_outputs(out: str, name: str) -> None:
    """Delete what an earlier attempt at this unit may have left, by exact names (a few requests
    whatever the number of units): its marker first (a marker never outlives the files it lists,
    whenever this is interrupted), then its parts (a stale count) last first, the dedup's
    rejected rows of each, and its hash file. The temp files of a write that was killed (a Ray
    retry after the worker died) are swept once per run (_sweep_temp_files)."""
    fsio.rm(fsio.join(out, "markers", f"{name}.json"))
    rejected = fsio.join(out, "rejected")
    parts = _numbered(out, f"part-{name}")
    for k in range(len(parts)):  # the corpus-wide dedup's rows taken out of part k
        fsio.rm(fsio.join(rejected, f"part-{name}-{k:03d}-dedup.parquet"))
        fsio.rm(fsio.join(rejected, f"part-{name}-{k:03d}-near.parquet"))  # near_dedup's
    for path in reversed(_numbered(rejected, f"part-{name}") + parts):
        fsio.rm(path)
    fsio.rm(fsio.join(out, "hashes", f"{name}.npy"))
    for path in minhash.unit_files(out, name):
        fsio.rm(path)


@dataclass
class _UnitCleaner:
    """One unit's running state: its part writers, the hashes of kept documents, counters."""

    c: CleanConfig
    filters: list[str]
    writer: PartWriter
    rejected: PartWriter | None
    near: minhash.UnitSignatures | None = None  # data.clean.near_dedup's rows of kept documents
    seen: set = dataclasses.field(default_factory=set)
    # 16-byte hash + 8-byte length each
    hashes: bytearray = dataclasses.field(default_factory=bytearray)
    # per input file: [documents in, bytes in, documents kept, bytes kept] (before the corpus-wide
    # dedup)
    per_file: dict = dataclasses.field(default_factory=dict)
    stats: dict = dataclasses.field(
        default_factory=lambda: {
            "docs_in": 0,
            "bytes_in": 0,
            "docs_kept": 0,
            "bytes_kept": 0,
            "drops": {},
            "drop_bytes": {},  # input bytes per drop reason (what a low yield is made of)
        }
    )

    def clean_piece(self, piece: Piece) -> FileReport:
        """Clean every record of one piece; a file that cannot be read is reported, not raised."""
        f = piece.file
        self.filters = active_filters(self.c, f.preset)  # its source's preset, else the run's
        report = FileReport(f.path)
        counts = self.per_file.setdefault(f.path, [0, 0, 0, 0])
        try:
            for rec in read_records(piece, self.c, report):
                report.records += 1
                self.stats["docs_in"] += 1
                self.stats["bytes_in"] += rec.nbytes
                counts[0] += 1
                counts[1] += rec.nbytes
                self._clean_record(rec, f, report)
        # ValueError: pyarrow decode errors
        except (
            BadInputFile,
            OSError,
            EOFError,
            ValueError,
        ) as e:
            if fsio.is_transient(e):  # the unit is run again (executor/), not the file failed
                raise
            report.error = f"{type(e).__name__}: {e}" if not isinstance(e, BadInputFile) else str(e)
            if f.path not in report.error:
                report.error = f"{f.path}: {report.error}"
            log.error("clean: file failed, continuing with the others: %s", report.error)
        return report

    def _clean_record(self, rec: Record, f: InputFile, report: FileReport) -> None:
        source = f.path
        # the file is this one record (no delimiter, or none matched)
        whole = f.kind != "parquet" and rec.nbytes >= f.size
        if rec.text is None:
            self._drop("length:too_long", rec, "", source)
            if whole:
                report.dropped_whole = "length:too_long"
            return
        text, nuls = normalize(rec.text)
        report.nul_chars += nuls
        doc = Doc(text)
        reason = apply_filters(doc, self.c, self.filters)
        if reason is not None:
            self._drop(reason, rec, doc.text, source)
            if whole and reason == "length:too_long":
                report.dropped_whole = reason  # a whole file, likely a corpus in one document
            return
        data = doc.text.encode("utf-8")
        if "dedup" in self.filters:
            h = text_hash(data)
            if h in self.seen:
                self._drop("dedup:duplicate", rec, doc.text, source)
                return
            self.seen.add(h)
            self.hashes += h + len(data).to_bytes(8, "little")
            if self.near is not None:
                url = rec.meta.get(self.c.near_dedup.url_field) if rec.meta else None
                self.near.add(doc.text, h, len(data), url)
        self.writer.add(doc.text, rec.id, source, *self._meta(rec))
        self.stats["docs_kept"] += 1
        self.stats["bytes_kept"] += len(data)
        counts = self.per_file[source]
        counts[2] += 1
        counts[3] += len(data)

    def _meta(self, rec: Record) -> list[str | None]:
        """The record's data.clean.metadata values, in that order (None: it has none)."""
        meta = rec.meta or {}
        return [meta.get(k) for k in self.c.metadata]

    def _drop(self, reason: str, rec: Record, text: str, source: str) -> None:
        self.stats["drops"][reason] = self.stats["drops"].get(reason, 0) + 1
        self.stats["drop_bytes"][reason] = self.stats["drop_bytes"].get(reason, 0) + rec.nbytes
        if self.rejected is not None:
            self.rejected.add(text, rec.id, source, *self._meta(rec), reason)


def _write_hashes(out: str, name: str, rows: bytearray) -> None:
    """hashes/NAME.npy: the unit's kept documents' rows (16-byte hash + 8-byte length), sorted
    by hash (the dedup's combine merges sorted files)."""
    hashes = np.frombuffer(bytes(rows), dtype=np.uint64).reshape(-1, 3)
    hashes = hashes[np.lexsort((hashes[:, 1], hashes[:, 0]))]
    with fsio.atomic_open(fsio.join(out, "hashes", f"{name}.npy"), "wb") as fh:
        np.save(fh, hashes)


def clean_unit(job: UnitJob) -> dict:
    """Clean one unit; write its parts, its hash file, then its marker. Returns the marker."""
    unit, c, out = job.unit, job.c, job.out
    started = time.time()
    _remove_unit_outputs(out, unit.name)
    meta = tuple(c.metadata)
    writer = PartWriter(
        out, f"part-{unit.name}", c.docs_per_shard, c.row_group_size, meta_columns=meta
    )
    rejected = (
        PartWriter(
            fsio.join(out, "rejected"),
            f"part-{unit.name}",
            c.docs_per_shard,
            c.row_group_size,
            with_reason=True,
            meta_columns=meta,
        )
        if c.keep_rejected
        else None
    )
    state = _UnitCleaner(c, job.filters, writer, rejected)
    if c.near_dedup.enabled:
        state.near = minhash.UnitSignatures(c.near_dedup)
    reports: list[dict] = []
    try:
        for piece in unit.pieces:
            report = state.clean_piece(piece)
            if report.bad():
                reports.append(dataclasses.asdict(report))
                # empty files are common (__init__.py): summarised at the end instead
                if not report.error:
                    (log.debug if report.empty else log.warning)(
                        "clean: bad input in %s: %s", piece.path, report.describe()
                    )
        parts = writer.close()
        if rejected is not None:
            rejected.close()
    except BaseException:
        writer.abort()
        if rejected is not None:
            rejected.abort()
        raise
    if "dedup" in job.filters:
        _write_hashes(out, unit.name, state.hashes)
    near = state.near.write(out, unit.name) if state.near is not None else None
    marker = {
        "unit": unit.name,
        "fingerprint": job.fingerprint,
        "pieces": [[p.path, p.start, p.end] for p in unit.pieces],
        "shards": parts,
        "part_bytes": writer.bytes,  # its parts' size on disk: what pack_groups packs by
        "failed": [r["path"] for r in reports if r["error"]],
        "bad_files": reports,
        "per_file": state.per_file,
        **({"near_dedup": near} if near is not None else {}),  # minhash/UNIT.npy's rows
        # who ran it and when: for the log and tests, never part of the output
        "worker": worker_id(),
        "started": started,
        "finished": time.time(),
        **state.stats,
    }
    # last: the unit is done
    fsio.write_json(fsio.join(out, "markers", f"{unit.name}.json"), marker)
    return marker


# ----------------------------------------------------------------------------------------------
# the stage


def run_clean(cfg) -> dict:
    """Clean cfg.data.clean.inputs into RUN/clean/. Returns the stats (also RUN/clean/stats.json);
    when other tasks of a job array are still running, returns this task's stats and writes none."""
    c = cfg.data.clean
    if c.num_tasks < 1 or not 0 <= c.task_index < c.num_tasks:
        raise ConfigError(
            f"data.clean.task_index={c.task_index} must be in 0..num_tasks-1 "
            f"(num_tasks={c.num_tasks})"
        )
    check_executor(cfg.data)
    near_dedup.check_config(c)
    if words.COUNTER is None:
        log.warning(
            "clean: the compiled word counter (pipeline/clean/_wordcount.c) is not built, so "
            "words are counted in Python at about half the speed; to build it, install a C "
            "compiler and reinstall codex (pip install -e .)"
        )
    if not c.inputs and not c.sources:
        raise ConfigError("data.clean.inputs is empty: pass --input PATH (or --sources FILE)")
    listed = _inputs_and_filters(c)
    where = where_for(
        cfg.data,
        c.workers,
        sum(f.size for f in listed[0]) // c.num_tasks,
        AUTO_BYTES_PER_WORKER,
        run=cfg.run,
    )
    stage = Stage(
        "codex data clean",
        cfg,
        rundir.clean_dir(cfg.run),
        "stats.json",
        later=(rundir.tokenizer_dir(cfg.run), rundir.shards_dir(cfg.run)),
    )
    # --workers N: one pool of N processes for the units and the corpus-wide dedup after them,
    # started now: they import the stage while this process plans the units
    with stage_pool(where, _warm) as where:
        stats = _clean(stage, c, where, listed)
    forget_pieces()  # the word cache of the units run in this process (workers=1)
    _refuse_bad_outcome(stats, stage.out)
    return stats


def _warm() -> None:
    """A pool worker's first task: unpickling it imports this module (the filters, their compiled
    regexes, numpy, pyarrow) before the first unit arrives."""


def _clean(stage: Stage, c: CleanConfig, where: Where, listed: tuple) -> dict:
    """The units not done yet, then (when every unit is) the corpus-wide dedup and stats.json;
    returns the stats. listed: _inputs_and_filters(c)."""
    out = stage.out
    files, skipped, filters = listed
    fingerprint = _fingerprint(c, files)
    units = plan_units(files, c)
    markers = _read_markers(stage, fingerprint)
    packed_away, leftover = _drop_markers_without_files(out, markers, dedup="dedup" in filters)
    mine = units[c.task_index :: c.num_tasks]
    todo = [u for u in mine if u.name not in markers or markers[u.name]["failed"]]
    if packed_away or leftover:
        finished = stage.finished()
        if not todo and len(markers) == len(units) and finished and finished.get("packed"):
            # done, parts packed: what a deletion left after stats.json, then nothing
            fsio.map_requests(fsio.rm, [fsio.join(out, p) for p in leftover], METADATA_THREADS)
            return {**finished, "units_run": 0}
        # the dedups and the packing read every unit's parts: units whose parts were packed
        # and deleted are cleaned again with the others
        if packed_away:
            log.warning(
                "clean: %d units to clean again, and %d whose parts were packed with them",
                len(todo),
                len(packed_away),
            )
        fsio.map_requests(
            fsio.rm,
            [fsio.join(out, "markers", f"{u}.json") for u in packed_away],
            METADATA_THREADS,
        )
        for u in packed_away:
            del markers[u]
        todo = [u for u in mine if u.name not in markers or markers[u.name]["failed"]]
    log.info(
        "clean: %d files (%.1f MB), %d skipped (unsupported type); %d units%s, %d to do on %s; "
        "filters: %s",
        len(files),
        sum(f.size for f in files) / 1e6,
        len(skipped),
        len(mine),
        f" of task {c.task_index}/{c.num_tasks}" if c.num_tasks > 1 else "",
        len(todo),
        where.executor if where.executor == "ray" else f"{where.workers} local worker(s)",
        ", ".join(filters),
    )
    if todo:  # the corpus changes: not under a tokenizer made from it, and not "finished" meanwhile
        stage.refuse_if_built_on(
            f"would be re-cleaned ({len(todo)} units without a finished marker)"
        )
        stage.start()
    fsio.makedirs(out)
    if c.num_tasks == 1 and _sweep_temp_files(out):
        log.info("clean: removed the temp files of an interrupted earlier run")
    jobs = [UnitJob(u, c, out, filters, fingerprint) for u in todo]
    for m in _process(jobs, where):
        markers[m["unit"]] = m
    if all(u.name in markers for u in units):
        stats = _finalize(stage, units, markers, filters, (files, skipped), where)
        stats["units_run"] = len(todo)
    else:
        waiting = sorted({u.index % c.num_tasks for u in units if u.name not in markers})
        log.info(
            "clean: task %d done; waiting for tasks %s (the last one to finish writes stats.json)",
            c.task_index,
            waiting,
        )
        stats = summarize([markers[u.name] for u in mine], filters, files, skipped)
        stats["units_run"] = len(todo)
    return stats


def _inputs_and_filters(c) -> tuple[list, list, list[str]]:
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


def usable(stats: dict) -> bool:
    """Whether a finished clean's corpus is one later stages take (_refuse_bad_outcome)."""
    failed = stats["bad_input"]["failed_files"]
    return not failed and stats["docs_out"] > 0 and not stats.get("low_yield")


def _refuse_bad_outcome(stats: dict, out: str) -> None:
    """Exit 1 for a run whose outputs are written but must not pass silently: failed input files,
    nothing kept, or under 1% kept (without --allow-low-yield)."""
    failed = stats["bad_input"]["failed_files"]
    if failed:
        raise CleanError(
            f"{len(failed)} input file(s) failed, the rest was cleaned (see {out}/stats.json): "
            + "; ".join(f["error"] for f in failed[:3])
        )
    if "shards" in stats and stats["docs_out"] == 0:
        raise CleanError(
            f"clean kept no documents ({nothing_kept(stats)}); outputs left in {out} for "
            "inspection: rerun with the fix and a new --run, or delete that folder first"
        )
    if stats.get("low_yield"):
        raise CleanError(
            f"{out}: {yield_problem(stats)}; if that is right, rerun with --allow-low-yield "
            "(only the dedup pass runs again)"
        )


def _drop_markers_without_files(
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
        if dedup and f"{name}.npy" not in hashes:
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
            fsio.rm(fsio.join(out, "markers", f"{name}.json"))
            del markers[name]
    return packed_away, leftover


def _read_markers(stage: Stage, fingerprint: str) -> dict[str, dict]:
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


def _read_marker(path: str) -> dict:
    return held(fsio.read_json(path))


def held(marker: dict) -> dict:
    """A unit's marker as the driver keeps it until the end: its keys, and those of its counts
    per drop reason, shared with every other marker's (sys.intern) instead of a copy each (JSON
    gives every marker its own), about half of what a marker holds; its pieces (the input it
    read, for people) left out."""
    m = {sys.intern(k): v for k, v in marker.items() if k != "pieces"}
    for key in ("drops", "drop_bytes"):
        if isinstance(m.get(key), dict):
            m[key] = {sys.intern(k): v for k, v in m[key].items()}
    return m


def _process(jobs: list[UnitJob], where: Where) -> list[dict]:
    if not jobs:
        return []
    done: list[dict] = []
    with Progress("clean", total=len(jobs), unit="units") as progress:
        for _, marker in run_units(
            clean_unit,
            jobs,
            where,
            progress,
            count=lambda _, m: {"docs": m["docs_in"], "bytes": m["bytes_in"]},
        ):
            done.append(held(marker))
    total = sum(m["bytes_in"] for m in done)
    log.info("clean: processed %.1f MB in %d units", total / 1e6, len(jobs))
    return done


# ----------------------------------------------------------------------------------------------
# final pass: exact dedup across units, then stats.json


def _finalize(
    stage: Stage, units: list[Unit], markers: dict, filters: list[str], inputs, where: Where
) -> dict:
    """The corpus-wide dedup over every unit's hashes, then stats.json (the commit marker).

    6 parameters: the stage, its plan and the markers it reads, and the run's settings."""
    files, skipped = inputs
    ordered = [markers[u.name] for u in units]
    cross_docs = cross_bytes = 0
    if "dedup" in filters:
        cross_docs, cross_bytes = dedup_corpus(stage.out, ordered, stage.cfg.data.clean, where)
    stats = summarize(ordered, filters, files, skipped)
    if cross_docs:
        stats["drops"].setdefault("dedup", {}).setdefault("duplicate", 0)
        stats["drops"]["dedup"]["duplicate"] += cross_docs
        stats["drop_bytes"].setdefault("dedup", {}).setdefault("duplicate", 0)
        stats["drop_bytes"]["dedup"]["duplicate"] += cross_bytes
        stats["drops_total"] += cross_docs
        stats["docs_out"] -= cross_docs
        stats["bytes_out"] -= cross_bytes
    stats["dedup_across_units"] = cross_docs
    if stage.cfg.data.clean.near_dedup.enabled:  # after the exact dedup: it leaves its copies
        got = near_dedup.near_dedup_corpus(stage.out, ordered, stage.cfg.data.clean, where)
        near_dedup.add_to_stats(stats, got)
    stats["shards"] = [s for m in ordered for s in m["shards"]]
    c = stage.cfg.data.clean
    if low_yield(stats, c.min_yield) and not c.allow_low_yield:
        stats["low_yield"] = c.min_yield  # clean_parts refuses it until a rerun allows it
    replaced: list[str] = []
    # a corpus to use: its units' parts packed. One refused (failed files, low yield, nothing
    # kept) keeps its units' parts, for the rerun that redoes some units or allows it.
    if usable(stats):
        stats["shards"], replaced = _pack(stage, ordered, where)
        stats["packed"] = bool(replaced)
    if c.num_tasks == 1:  # what killed unit attempts left (a Ray retry): one listing a folder
        _sweep_temp_files(stage.out)
    stage.commit(stats)
    # once stats.json lists the packed parts, the units' own are not needed
    fsio.map_requests(fsio.rm, [fsio.join(stage.out, p) for p in replaced], METADATA_THREADS)
    log.info(
        "clean: %d -> %d documents (%.1f -> %.1f MB), %d dropped: %s",
        stats["docs_in"],
        stats["docs_out"],
        stats["bytes_in"] / 1e6,
        stats["bytes_out"] / 1e6,
        stats["drops_total"],
        ", ".join(f"{k} {sum(v.values())}" for k, v in stats["drops"].items()) or "none",
    )
    _warn_about(stats, stage.out)
    return stats


# ----------------------------------------------------------------------------------------------
# packing: consecutive units' parts into parts of about data.clean.part_bytes


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


def _pack(stage: Stage, ordered: list[dict], where: Where) -> tuple[list[str], list[str]]:
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


def _warn_about(stats: dict, out: str) -> None:
    """The warnings a finished clean logs: bad input, whole files dropped, files that kept under
    1% of their bytes, and one filter dropping most documents (with its fix)."""
    bad = stats["bad_input"]
    summary = [
        f"{bad[k]['count']} {k.replace('_', ' ')} in {bad[k]['files']} files"
        for k in (
            "empty_files",
            "invalid_utf8_records",
            "nul_chars",
            "oversized_records",
            "null_values",
            "malformed_lines",
        )
        if bad[k]["count"]
    ]
    if bad["failed_files"]:
        summary.append(f"{len(bad['failed_files'])} failed files")
    if summary:
        log.warning("clean: bad input (details in stats.json): %s", ", ".join(summary))
    whole = whole_files_dropped(stats)
    if whole:
        log.warning("clean: %s", whole)
    starved = stats["files"]["low_yield_files"]
    if starved:
        worst = ", ".join(
            f"{e['path']} ({100 * e['bytes_kept'] / max(e['bytes_in'], 1):.1f}%)"
            for e in stats["per_file"][:3]
        )
        log.warning(
            "clean: %d input file(s) kept under 1%% of their bytes (%s); per_file in %s/stats.json",
            starved,
            worst,
            out,
        )
    top = top_drop(stats)
    if top and stats["docs_out"] and top[2] > stats["docs_in"] // 2:
        log.warning(
            "clean: %s:%s dropped %d of %d documents (%.0f%%); "
            "if that is wrong for this corpus, %s",
            top[0],
            top[1],
            top[2],
            stats["docs_in"],
            100 * top[2] / stats["docs_in"],
            drop_fix(top[0], top[1]),
        )
