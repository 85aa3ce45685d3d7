"""`codex data clean`: raw text -> normalised, filtered, exactly deduplicated parquet shards.

    files --(sorted, task I takes files I, I+N, ...)--> chunks of <= chunk_bytes
                                                        (a file never split)
    chunk --read--> normalize --> filters (preset) --> in-chunk dedup
          --> part-TTTTT-CCCCC-SSS.parquet
            + hashes/TTTTT-CCCCC.npy
            + markers/TTTTT-CCCCC.json  (last)
    all chunks done --> cross-chunk dedup over the hash files --> rewrite affected shards
                    --> config.yaml, stats.json (last)

Units of work: a chunk (consecutive files of one task, about chunk_bytes of input) is processed by
one worker start to finish and writes its own shards, so 1 or N workers give byte-identical output
and a killed run redoes only the chunks without a marker. The plan depends only on the inputs and
settings (not on --workers), and every machine of a job array computes the same plan.

Exact dedup across the whole corpus: each chunk drops duplicates inside itself and writes the
128-bit BLAKE2b hash (+ byte length) of every document it kept. When every chunk has its marker,
the final pass groups all hashes (in hash-prefix buckets to bound memory) and keeps the first
occurrence in (task, chunk) order; shards holding later copies are rewritten without them. The
rewrite is idempotent (rows are matched by hash, not position), so a rerun after a kill during
the final pass gives the same result. The last task of a job array to finish runs it; any rerun
does too.

Bad input is counted per file and reported in stats.json and the log; it never stops the run. A
file that cannot be used at all (unreadable, parquet without the text column) is reported as
failed, the other files are cleaned; its chunk gets no completion credit (its marker lists the
failure), so a rerun after fixing the file redoes that chunk, and run_clean raises at the end so
the job does not look successful.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import time
from dataclasses import dataclass

import numpy as np

from codex import fsio, rundir
from codex.config import ConfigError
from codex.progress import Progress, setup_logging
from pipeline.clean.dedup import cross_chunk_duplicates, rewrite_without
from pipeline.clean.filters import Doc, active_filters, apply_filters, normalize
from pipeline.clean.parts import PartWriter
from pipeline.clean.stats import drop_fix, nothing_kept, summarize, top_drop
from pipeline.inputs import list_inputs, ls_matching
from pipeline.readers import BadInputFile, FileReport, InputFile, Record, read_records
from pipeline.stage import Stage

log = logging.getLogger("codex.clean")

# Settings that change what is written (part of the plan fingerprint); others (workers,
# task_index) only change how it is computed.
_RUNTIME_KEYS = ("workers", "task_index")


class CleanError(RuntimeError):
    """Some input files could not be used; everything else was cleaned (see stats.json)."""


@dataclass
class Chunk:
    task: int
    index: int
    files: list[InputFile]

    @property
    def name(self) -> str:
        return f"{self.task:05d}-{self.index:05d}"


def plan_chunks(files: list[InputFile], num_tasks: int, chunk_bytes: int) -> list[Chunk]:
    """Task I takes files I, I+N, ...; its files are cut into consecutive chunks of ~chunk_bytes."""
    chunks: list[Chunk] = []
    for task in range(num_tasks):
        current: list[InputFile] = []
        size = 0
        for f in files[task::num_tasks]:
            if current and size + f.size > chunk_bytes:
                chunks.append(Chunk(task, len([c for c in chunks if c.task == task]), current))
                current, size = [], 0
            current.append(f)
            size += f.size
        if current:
            chunks.append(Chunk(task, len([c for c in chunks if c.task == task]), current))
    return chunks


def _fingerprint(c, files: list[InputFile]) -> str:
    settings = {k: v for k, v in dataclasses.asdict(c).items() if k not in _RUNTIME_KEYS}
    blob = json.dumps(
        {"settings": settings, "files": [(f.path, f.size) for f in files]}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# one chunk (runs in a worker process)

_progress_queue = None
_parent_pid = None


def _init_worker(q, parent_pid: int) -> None:
    global _progress_queue, _parent_pid
    _progress_queue, _parent_pid = q, parent_pid
    setup_logging()


def _remove_chunk_outputs(out: str, name: str) -> None:
    """Delete what an interrupted earlier attempt at this chunk may have left (stale shard
    counts)."""
    for sub, pattern in (
        ("", f"part-{name}-*.parquet"),
        ("rejected", f"part-{name}-*.parquet"),
        ("hashes", f"{name}.npy"),
    ):
        for path in ls_matching(fsio.join(out, sub) if sub else out, pattern):
            fsio.rm(path)


@dataclass
class _ChunkCleaner:
    """One chunk's running state: its part writers, the hashes of kept documents, counters."""

    c: object  # CleanConfig
    filters: list[str]
    writer: PartWriter
    rejected: PartWriter | None
    report_progress: object = None
    seen: set = dataclasses.field(default_factory=set)
    # 16-byte hash + 8-byte length each
    hashes: bytearray = dataclasses.field(default_factory=bytearray)
    stats: dict = dataclasses.field(
        default_factory=lambda: {
            "docs_in": 0,
            "bytes_in": 0,
            "docs_kept": 0,
            "bytes_kept": 0,
            "drops": {},
        }
    )
    pending_docs: int = 0
    pending_bytes: int = 0
    last_report: float = dataclasses.field(default_factory=time.perf_counter)

    def clean_file(self, f: InputFile) -> FileReport:
        """Clean every record of one file; a file that cannot be read is reported, not raised."""
        report = FileReport(f.path)
        try:
            for rec in read_records(f, self.c, report):
                report.records += 1
                self.stats["docs_in"] += 1
                self.stats["bytes_in"] += rec.nbytes
                self.pending_docs += 1
                self.pending_bytes += rec.nbytes
                self._clean_record(rec, f.path, report)
                self._maybe_report_progress()
        # ValueError: pyarrow decode errors
        except (
            BadInputFile,
            OSError,
            EOFError,
            ValueError,
        ) as e:
            report.error = f"{type(e).__name__}: {e}" if not isinstance(e, BadInputFile) else str(e)
            if f.path not in report.error:
                report.error = f"{f.path}: {report.error}"
            log.error("clean: file failed, continuing with the others: %s", report.error)
        return report

    def _clean_record(self, rec: Record, source: str, report: FileReport) -> None:
        if rec.text is None:
            self._drop("length:too_long", rec, "", source)
            return
        text, nuls = normalize(rec.text)
        report.nul_chars += nuls
        doc = Doc(text)
        reason = apply_filters(doc, self.c, self.filters)
        if reason is not None:
            self._drop(reason, rec, doc.text, source)
            return
        data = doc.text.encode("utf-8")
        if "dedup" in self.filters:
            h = hashlib.blake2b(data, digest_size=16).digest()
            if h in self.seen:
                self._drop("dedup:duplicate", rec, doc.text, source)
                return
            self.seen.add(h)
            self.hashes += h + len(data).to_bytes(8, "little")
        self.writer.add(doc.text, rec.id, source)
        self.stats["docs_kept"] += 1
        self.stats["bytes_kept"] += len(data)

    def _drop(self, reason: str, rec: Record, text: str, source: str) -> None:
        self.stats["drops"][reason] = self.stats["drops"].get(reason, 0) + 1
        if self.rejected is not None:
            self.rejected.add(text, rec.id, source, reason)

    def _maybe_report_progress(self) -> None:
        if self.pending_docs >= 256:
            now = time.perf_counter()
            if now - self.last_report > 0.5:
                self.flush_progress()
                self.last_report = now

    def flush_progress(self) -> None:
        _send_progress(self.report_progress, self.pending_docs, self.pending_bytes)
        self.pending_docs = self.pending_bytes = 0


def clean_chunk(
    chunk: Chunk, c, out: str, filters: list[str], fingerprint: str, report_progress=None
) -> dict:
    """Clean one chunk; write its parts, its hash file, then its marker. Returns the marker."""
    _remove_chunk_outputs(out, chunk.name)
    writer = PartWriter(out, f"part-{chunk.name}", c.docs_per_shard, c.row_group_size)
    rejected = (
        PartWriter(
            fsio.join(out, "rejected"),
            f"part-{chunk.name}",
            c.docs_per_shard,
            c.row_group_size,
            with_reason=True,
        )
        if c.keep_rejected
        else None
    )
    state = _ChunkCleaner(c, filters, writer, rejected, report_progress)
    reports: list[dict] = []
    try:
        for f in chunk.files:
            report = state.clean_file(f)
            if report.bad():
                reports.append(dataclasses.asdict(report))
                # empty files are common (__init__.py): summarised at the end instead
                if not report.error:
                    (log.debug if report.empty else log.warning)(
                        "clean: bad input in %s: %s", f.path, report.describe()
                    )
        parts = writer.close()
        if rejected is not None:
            rejected.close()
    except BaseException:
        writer.abort()
        if rejected is not None:
            rejected.abort()
        raise
    state.flush_progress()
    if "dedup" in filters:
        with fsio.atomic_open(fsio.join(out, "hashes", f"{chunk.name}.npy"), "wb") as fh:
            np.save(fh, np.frombuffer(bytes(state.hashes), dtype=np.uint64).reshape(-1, 3))
    marker = {
        "chunk": chunk.name,
        "fingerprint": fingerprint,
        "files": len(chunk.files),
        "shards": parts,
        "failed": [r["path"] for r in reports if r["error"]],
        "bad_files": reports,
        **state.stats,
    }
    # last: the chunk is done
    fsio.write_json(fsio.join(out, "markers", f"{chunk.name}.json"), marker)
    return marker


def _send_progress(report_progress, docs: int, nbytes: int) -> None:
    if not docs:
        return
    if report_progress is not None:
        report_progress(docs, nbytes)
    elif _progress_queue is not None:
        _progress_queue.put((docs, nbytes))
        if os.getppid() != _parent_pid:  # the parent was killed: do not keep writing as an orphan
            os._exit(3)


def _chunk_job(args) -> dict:
    return clean_chunk(*args)


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
    if c.workers < 1:
        raise ConfigError(f"data.clean.workers must be >= 1, got {c.workers}")
    if not c.inputs:
        raise ConfigError("data.clean.inputs is empty: pass --input PATH")
    filters = active_filters(c)
    stage = Stage(
        "codex data clean",
        cfg,
        rundir.clean_dir(cfg.run),
        "stats.json",
        later=(rundir.tokenizer_dir(cfg.run), rundir.shards_dir(cfg.run)),
    )
    out = stage.out
    try:
        files, skipped = list_inputs(c.inputs, c.text_extensions)
    except BadInputFile as e:
        raise ConfigError(str(e)) from None
    if not files:
        raise ConfigError(
            f"no input files of a supported type in {c.inputs} (skipped {len(skipped)})"
        )
    fingerprint = _fingerprint(c, files)
    chunks = plan_chunks(files, c.num_tasks, c.chunk_bytes)
    markers = _read_markers(stage, fingerprint)
    mine = [ch for ch in chunks if ch.task == c.task_index]
    todo = [ch for ch in mine if ch.name not in markers or markers[ch.name]["failed"]]
    log.info(
        "clean: %d files (%.1f MB), %d skipped (unsupported type); "
        "task %d/%d: %d chunks, %d to do; filters: %s",
        len(files),
        sum(f.size for f in files) / 1e6,
        len(skipped),
        c.task_index,
        c.num_tasks,
        len(mine),
        len(todo),
        ", ".join(filters),
    )
    if todo:  # the corpus changes: not under a tokenizer made from it, and not "finished" meanwhile
        stage.refuse_if_built_on(
            f"would be re-cleaned ({len(todo)} chunks without a finished marker)"
        )
        stage.start()
    fsio.makedirs(out)
    for m in _process(todo, c, out, filters, fingerprint):
        markers[m["chunk"]] = m
    if all(ch.name in markers for ch in chunks):
        stats = _finalize(stage, chunks, markers, filters, files, skipped)
    else:
        waiting = sorted({ch.task for ch in chunks if ch.name not in markers})
        log.info(
            "clean: task %d done; waiting for tasks %s (the last one to finish writes stats.json)",
            c.task_index,
            waiting,
        )
        stats = summarize([markers[ch.name] for ch in mine], filters, files, skipped)
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
    return stats


def _read_markers(stage: Stage, fingerprint: str) -> dict[str, dict]:
    markers = {}
    for path in ls_matching(fsio.join(stage.out, "markers"), "*.json"):
        m = fsio.read_json(path)
        if m.get("fingerprint") != fingerprint:
            stage.refuse(
                f"holds output cleaned from other inputs or settings ({path})",
                f"use another --run or delete {stage.out}",
            )
        markers[m["chunk"]] = m
    return markers


def _process(todo: list[Chunk], c, out: str, filters: list[str], fingerprint: str) -> list[dict]:
    if not todo:
        return []
    total_bytes = sum(f.size for ch in todo for f in ch.files)
    done: list[dict] = []
    with Progress("clean", total=len(todo), unit="chunks") as progress:

        def on_progress(docs, nbytes):
            progress.update(0, docs=docs, bytes=nbytes)

        progress.update(0, bytes=0)
        if c.workers == 1 or len(todo) == 1:
            for ch in todo:
                done.append(clean_chunk(ch, c, out, filters, fingerprint, on_progress))
                progress.update(1)
        else:
            ctx = mp.get_context("spawn")  # fork is unsafe with gcsfs' event-loop threads
            q = ctx.Queue()
            with ctx.Pool(
                min(c.workers, len(todo)), initializer=_init_worker, initargs=(q, os.getpid())
            ) as pool:
                pending = [
                    pool.apply_async(_chunk_job, ((ch, c, out, filters, fingerprint),))
                    for ch in todo
                ]
                while pending:
                    try:
                        while True:
                            on_progress(*q.get(timeout=0.2))
                    except queue_mod.Empty:
                        pass
                    for r in [r for r in pending if r.ready()]:
                        done.append(r.get())  # re-raises a worker's exception
                        pending.remove(r)
                        progress.update(1)
                while True:
                    try:
                        on_progress(*q.get_nowait())
                    except queue_mod.Empty:
                        break
    log.info("clean: processed %.1f MB in %d chunks", total_bytes / 1e6, len(todo))
    return done


# ----------------------------------------------------------------------------------------------
# final pass: exact dedup across chunks, then stats.json


def _finalize(
    stage: Stage, chunks: list[Chunk], markers: dict, filters: list[str], files, skipped
) -> dict:
    c, out = stage.cfg.data.clean, stage.out
    ordered = [markers[ch.name] for ch in chunks]
    cross_docs = cross_bytes = 0
    if "dedup" in filters:
        drops = cross_chunk_duplicates(
            out, [ch.name for ch in chunks], sum(m["docs_kept"] for m in ordered)
        )
        for ch in chunks:
            if ch.name in drops:
                cross_docs += len(drops[ch.name])
                cross_bytes += sum(drops[ch.name].values())
                rewrite_without(out, markers[ch.name]["shards"], drops[ch.name], c)
    stats = summarize(ordered, filters, files, skipped)
    if cross_docs:
        stats["drops"].setdefault("dedup", {}).setdefault("duplicate", 0)
        stats["drops"]["dedup"]["duplicate"] += cross_docs
        stats["drops_total"] += cross_docs
        stats["docs_out"] -= cross_docs
        stats["bytes_out"] -= cross_bytes
    stats["dedup_across_chunks"] = cross_docs
    stats["shards"] = [s for m in ordered for s in m["shards"]]
    stage.commit(stats)
    log.info(
        "clean: %d -> %d documents (%.1f -> %.1f MB), %d dropped: %s",
        stats["docs_in"],
        stats["docs_out"],
        stats["bytes_in"] / 1e6,
        stats["bytes_out"] / 1e6,
        stats["drops_total"],
        ", ".join(f"{k} {sum(v.values())}" for k, v in stats["drops"].items()) or "none",
    )
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
    return stats
