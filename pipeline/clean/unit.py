"""Cleaning one unit, in a worker (this process, a pool process or a Ray task): read its pieces,
normalise, filter and deduplicate inside the unit, then write its parts, its hash file and, last,
its marker. A retried unit first removes what an earlier attempt left (remove_unit_outputs).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np

from codex.core import fsio
from codex.core.config.data import CleanConfig
from codex.pipeline.clean import decontam, minhash
from codex.pipeline.clean.dedup import text_hash
from codex.pipeline.clean.fasttext_filters import score_columns
from codex.pipeline.clean.filters import Doc, active_filters, apply_filters, normalize
from codex.pipeline.clean.parts import PartWriter, hash_path, marker_path, part_prefix
from codex.pipeline.clean.plan import Unit
from codex.pipeline.executor import worker_id
from codex.pipeline.readers import (
    BadInputFile,
    FileReport,
    InputFile,
    Piece,
    Record,
    read_records,
)

log = logging.getLogger("codex.clean")


@dataclass
class UnitJob:
    """What a worker needs to clean one unit (picklable)."""

    unit: Unit
    c: CleanConfig
    out: str
    filters: list[str]
    fingerprint: str
    decontam: str = ""  # the eval sets' table (decontam.write_table), when decontam runs
    # the files an earlier run's marker of this unit lists (marker_files), removed first
    previous: tuple[str, ...] = ()


def marker_files(out: str, marker: dict) -> tuple[str, ...]:
    """Every file a unit's marker vouches for, in the order a retry removes them
    (remove_unit_outputs): the marker first (a marker never outlives the files it lists, whenever
    the removal is interrupted), the corpus-wide dedups' rejected rows of each part, the rejected
    parts and the parts, last first, the hash file, near-dedup's files. A marker written before
    markers listed their rejected parts: those are probed by name."""
    name = marker["unit"]
    rejected = fsio.join(out, "rejected")
    parts = [fsio.join(out, p) for p in marker.get("shards", ())]
    if "rejected" in marker:
        gone = [fsio.join(rejected, p) for p in marker["rejected"]]
    else:
        gone = _numbered(rejected, part_prefix(out, name))
    rows = [
        fsio.join(rejected, fsio.basename(p).replace(".parquet", f"-{kind}.parquet"))
        for p in parts
        for kind in ("dedup", "near")
    ]
    files = [marker_path(out, name), *rows, *reversed(gone + parts)]
    files.append(hash_path(out, name))
    if "near_dedup" in marker:
        files += minhash.unit_files(out, name)
    return tuple(files)


def _numbered(folder: str, prefix: str, suffix: str = ".parquet") -> list[str]:
    """The files folder/PREFIX-000SUFFIX, -001, ... that exist, probed by exact name up to the
    first missing one (a PartWriter writes them in order)."""
    found: list[str] = []
    while fsio.exists(path := fsio.join(folder, f"{prefix}-{len(found):03d}{suffix}")):
        found.append(path)
    return found


def remove_unit_outputs(previous: tuple[str, ...]) -> None:
    """Delete what an earlier run of this unit left: the files its marker lists (marker_files,
    read by the driver), by exact name, in that order; no listing and no existence check, one
    request a file. A unit without a marker needs none: its earlier attempt (killed, or a Ray
    retry after its worker died) wrote the files this one writes, under the same names (the
    plan fingerprint fixes them), and a remote write is whole or absent. The temp files of a
    local write that was killed are swept once per run (finalize.py: sweep_temp_files)."""
    for path in previous:
        fsio.rm(path)


@dataclass
class _UnitCleaner:
    """One unit's running state: its part writers, the hashes of kept documents, counters."""

    c: CleanConfig
    filters: list[str]
    writer: PartWriter
    rejected: PartWriter | None
    near: minhash.UnitSignatures | None = None  # data.clean.near_dedup's rows of kept documents
    matcher: decontam.Matcher | None = None  # data.clean.decontam's eval sets
    mark: bool = False  # decontam's mode mark: a `contaminated` column after the metadata
    # per eval set: [documents, input bytes] that share an n-gram with it
    contaminated: dict = dataclasses.field(default_factory=dict)
    scores: tuple[str, ...] = ()  # the score columns' names (fasttext_filters.py)
    seen: set = dataclasses.field(default_factory=set)
    # 16-byte hash + 8-byte length each
    hashes: bytearray = dataclasses.field(default_factory=bytearray)
    # per input file: [documents in, bytes in, documents kept, bytes kept] (before the corpus-wide
    # dedup)
    per_file: dict = dataclasses.field(default_factory=dict)
    # per source (InputFile.source): its counts as in `stats`, and its drops: "filter:reason" ->
    # [documents, input bytes]
    per_source: dict = dataclasses.field(default_factory=dict)
    stats: dict = dataclasses.field(
        default_factory=lambda: {
            "docs_in": 0,
            "bytes_in": 0,
            "docs_kept": 0,
            "bytes_kept": 0,
            "drops": {},
            "drop_bytes": {},  # input bytes per drop reason (what a low yield is made of)
            "drop_kinds": {},  # per drop reason: input bytes per format (what orders its fixes)
            # data.clean.lang: per language -> [documents, input bytes, documents kept, bytes kept]
            "langs": {},
        }
    )

    def clean_piece(self, piece: Piece) -> FileReport:
        """Clean every record of one piece; a file that cannot be read is reported, not raised."""
        f = piece.file
        self.filters = active_filters(self.c, f.preset)  # its source's preset, else the run's
        report = FileReport(f.path)
        counts = self.per_file.setdefault(f.path, [0, 0, 0, 0])
        source = self._source(f)
        try:
            for rec in read_records(piece, self.c, report):
                report.records += 1
                self.stats["docs_in"] += 1
                self.stats["bytes_in"] += rec.nbytes
                counts[0] += 1
                counts[1] += rec.nbytes
                source["docs_in"] += 1
                source["bytes_in"] += rec.nbytes
                self._clean_record(rec, f, report)
        # ValueError: pyarrow decode errors
        except (
            BadInputFile,
            OSError,
            EOFError,
            ValueError,
        ) as e:
            if fsio.is_store_failure(e):  # the storage failed, not the file: the unit fails
                raise
            said = str(e).strip()
            # an exception without a message (a bare EOFError) is named by its type
            report.error = said if isinstance(e, BadInputFile) and said else type(e).__name__
            if said and not isinstance(e, BadInputFile):
                report.error += f": {said}"
            if f.path not in report.error:
                report.error = f"{f.path}: {report.error}"
            log.error("clean: file failed, continuing with the others: %s", report.error)
        if f.not_read:  # a link not read (skipped or failed): no row in per_file
            self.per_file.pop(f.path, None)
        return report

    def _source(self, f: InputFile) -> dict:
        """The counts of f's source in this unit."""
        return self.per_source.setdefault(
            f.source,
            {"docs_in": 0, "bytes_in": 0, "docs_kept": 0, "bytes_kept": 0, "drops": {}},
        )

    def _clean_record(self, rec: Record, f: InputFile, report: FileReport) -> None:
        source = f.path
        # a text file that is this one record (no delimiter, or none matched); a .jsonl's line is
        # a record whatever its size (a compressed file's lines are bigger than the file)
        whole = f.kind == "text" and rec.nbytes >= f.size
        if rec.text is None:
            self._drop("length:too_long", rec, "", f)
            if whole:
                report.dropped_whole = "length:too_long"
            return
        text, nuls = normalize(rec.text)
        report.nul_chars += nuls
        doc = Doc(text)
        reason = apply_filters(doc, self.c, self.filters)
        lang = self._count_lang(doc, rec)
        if reason is not None:
            self._drop(reason, rec, doc.text, f, doc)
            if whole and reason == "length:too_long":
                report.dropped_whole = reason  # a whole file, likely a corpus in one document
            return
        hit = None
        if self.matcher is not None and "decontam" in self.filters:
            hit = self.matcher.match(doc.text)
            if hit is not None:
                self.contaminated[hit][0] += 1
                self.contaminated[hit][1] += rec.nbytes
                if not self.mark:
                    self._drop(f"decontam:{hit}", rec, doc.text, f, doc)
                    return
        data = doc.text.encode("utf-8")
        if "dedup" in self.filters:
            h = text_hash(data)
            if h in self.seen:
                self._drop("dedup:duplicate", rec, doc.text, f, doc, hit)
                return
            self.seen.add(h)
            self.hashes += h + len(data).to_bytes(8, "little")
            if self.near is not None:
                url = rec.meta.get(self.c.near_dedup.url_field) if rec.meta else None
                self.near.add(doc.text, h, len(data), url)
        self.writer.add(doc.text, rec.id, source, *self._meta(rec, hit), *self._scores(doc))
        if lang is not None:
            lang[2] += 1
            lang[3] += len(data)
        self.stats["docs_kept"] += 1
        self.stats["bytes_kept"] += len(data)
        counts = self.per_file[source]
        counts[2] += 1
        counts[3] += len(data)
        mine = self.per_source[f.source]
        mine["docs_kept"] += 1
        mine["bytes_kept"] += len(data)

    def _meta(self, rec: Record, hit: str | None = None) -> list[str | None]:
        """The record's data.clean.metadata values, in that order (None: it has none), then
        in decontam's mark mode the eval set it shares an n-gram with."""
        meta = rec.meta or {}
        return [meta.get(k) for k in self.c.metadata] + ([hit] if self.mark else [])

    def _scores(self, doc: Doc | None) -> list:
        """The document's score columns, in order (None where its filters did not run)."""
        cols = doc.columns if doc is not None else {}
        return [cols.get(name) for name in self.scores]

    def _count_lang(self, doc: Doc, rec: Record) -> list[int] | None:
        """Count the document under its language (data.clean.lang ran on it); its row of
        stats["langs"], None without a language."""
        lang = doc.columns.get("lang")
        if lang is None:
            return None
        row = self.stats["langs"].setdefault(lang, [0, 0, 0, 0])
        row[0] += 1
        row[1] += rec.nbytes
        return row

    def _drop(
        self,
        reason: str,
        rec: Record,
        text: str,
        f: InputFile,
        doc: Doc | None = None,
        hit: str | None = None,
    ) -> None:
        self.stats["drops"][reason] = self.stats["drops"].get(reason, 0) + 1
        self.stats["drop_bytes"][reason] = self.stats["drop_bytes"].get(reason, 0) + rec.nbytes
        kinds = self.stats["drop_kinds"].setdefault(reason, {})
        kinds[f.kind] = kinds.get(f.kind, 0) + rec.nbytes
        drops = self.per_source[f.source]["drops"]  # [documents, input bytes]
        drops.setdefault(reason, [0, 0])
        drops[reason][0] += 1
        drops[reason][1] += rec.nbytes
        if self.rejected is not None:
            row = [*self._meta(rec, hit), *self._scores(doc), reason]
            self.rejected.add(text, rec.id, f.path, *row)


def _write_hashes(out: str, name: str, rows: bytearray) -> None:
    """hashes/NAME.npy: the unit's kept documents' rows (16-byte hash + 8-byte length), sorted
    by hash (the dedup's combine merges sorted files)."""
    hashes = np.frombuffer(bytes(rows), dtype=np.uint64).reshape(-1, 3)
    hashes = hashes[np.lexsort((hashes[:, 1], hashes[:, 0]))]
    with fsio.atomic_open(hash_path(out, name), "wb") as fh:
        np.save(fh, hashes)


def _unit_cleaner(job: UnitJob) -> _UnitCleaner:
    """The unit's running state: its part writers (the rows' columns: text, id, source, the
    metadata, decontam's mark, the score columns) and decontam's eval sets."""
    c, out, name = job.c, job.out, part_prefix(job.out, job.unit.name)
    mark = bool(job.decontam) and c.decontam.mode == "mark"
    meta = tuple(c.metadata) + (("contaminated",) if mark else ())
    scores = score_columns(c, job.filters)
    writer = PartWriter(
        out, name, c.docs_per_shard, c.row_group_size, meta_columns=meta, score_columns=scores
    )
    rejected = (
        PartWriter(
            fsio.join(out, "rejected"),
            name,
            c.docs_per_shard,
            c.row_group_size,
            with_reason=True,
            meta_columns=meta,
            score_columns=scores,
        )
        if c.keep_rejected
        else None
    )
    scored = tuple(n for n, _ in scores)
    state = _UnitCleaner(c, job.filters, writer, rejected, mark=mark, scores=scored)
    if job.decontam:
        names = decontam.set_names(c.decontam)
        state.matcher = decontam.Matcher(job.decontam, names, c.decontam.n)
        state.contaminated = {name: [0, 0] for name in names}
    return state


def clean_unit(job: UnitJob) -> dict:
    """Clean one unit; write its parts, its hash file, then its marker. Returns the marker."""
    unit, c, out = job.unit, job.c, job.out
    started = time.time()
    remove_unit_outputs(job.previous)
    state = _unit_cleaner(job)
    writer, rejected = state.writer, state.rejected
    if c.near_dedup.enabled:
        state.near = minhash.UnitSignatures(c.near_dedup)
    reports: list[dict] = []
    try:
        for piece in unit.pieces:
            report = state.clean_piece(piece)
            if report.bad():
                reports.append(dataclasses.asdict(report))
                # empty files (__init__.py) and links not read are common: summarised at the
                # end instead
                if not report.error:
                    (log.debug if report.empty or report.skipped_link else log.warning)(
                        "clean: bad input in %s: %s", piece.path, report.describe()
                    )
        parts = writer.close()
        rejected_parts = rejected.close() if rejected is not None else []
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
        **({"rejected": rejected_parts} if rejected is not None else {}),  # under rejected/
        "part_bytes": writer.bytes,  # its parts' size on disk: what pack_groups packs by
        "failed": [r["path"] for r in reports if r["error"]],
        "bad_files": reports,
        "per_file": state.per_file,
        "per_source": state.per_source,
        **({"near_dedup": near} if near is not None else {}),  # minhash/UNIT.npy's rows
        # per eval set: [documents, input bytes] sharing an n-gram with it (dropped or marked)
        **({"decontam": state.contaminated} if job.decontam else {}),
        # who ran it and when: for the log and tests, never part of the output
        "worker": worker_id(),
        "started": started,
        "finished": time.time(),
        **state.stats,
    }
    # last: the unit is done
    fsio.write_json(marker_path(out, unit.name), marker)
    return marker
