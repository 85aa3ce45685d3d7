"""`codex data clean`: raw text -> normalised, filtered, exactly deduplicated parquet parts.

This module is the stage from top to bottom (run_clean): plan the units (plan.py), clean those not
done yet (unit.py: one a worker, through pipeline/executor/), then, once every unit is, the
corpus-wide dedup, stats.json and packing (finalize.py, pack.py). Bad input is counted per file and
never stops the run; a file that cannot be used fails the run at the end, after the rest is
cleaned. The flow, the resume and the job array are in docs/stages.md ("clean").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from codex.core import fsio, rundir
from codex.core.config import ConfigError
from codex.core.config.data import CleanConfig
from codex.core.progress import Progress
from codex.pipeline.clean import decontam, fasttext_filters, near_dedup, words
from codex.pipeline.clean.finalize import finalize, refuse_bad_outcome, sweep_temp_files
from codex.pipeline.clean.parts import marker_path
from codex.pipeline.clean.plan import (
    METADATA_THREADS,
    Unit,
    drop_markers_without_files,
    held,
    inputs_and_filters,
    plan_fingerprint,
    plan_units,
    read_markers,
)
from codex.pipeline.clean.stats import source_summary, summarize
from codex.pipeline.clean.unit import UnitJob, clean_unit, marker_files
from codex.pipeline.clean.words import forget_pieces
from codex.pipeline.executor import (
    Where,
    check_executor,
    run_units,
    stage_pool,
    where_for,
)
from codex.pipeline.stage import Stage

log = logging.getLogger("codex.clean")

# --workers 0: one process per this much input at most; a process's start (spawn, imports) is
# won back only above it (measured: README's stage table)
AUTO_BYTES_PER_WORKER = 8 << 20


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
    listed = inputs_and_filters(c)
    fasttext_filters.check_config(c, listed[2])
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
    for line in source_summary(stats):  # every finished run, refused or not
        log.info("clean: %s", line)
    refuse_bad_outcome(stats, stage.out)
    return stats


def _warm() -> None:
    """A pool worker's first task: unpickling it imports this module (the filters, their compiled
    regexes, numpy, pyarrow) before the first unit arrives."""


def _clean(stage: Stage, c: CleanConfig, where: Where, listed: tuple) -> dict:
    """The units not done yet, then (when every unit is) the corpus-wide dedup and stats.json;
    returns the stats. listed: inputs_and_filters(c)."""
    out = stage.out
    files, skipped, filters = listed
    # read once here; the workers load the table write_table makes of them
    evals = decontam.read_eval_sets(c.decontam) if "decontam" in filters else None
    fingerprint = plan_fingerprint(c, files, evals.fingerprint if evals else "")
    units = plan_units(files, c)
    markers = read_markers(stage, fingerprint)
    packed_away, leftover = drop_markers_without_files(out, markers, dedup="dedup" in filters)
    # what a unit done again removes first: its earlier marker's files (a failed unit's marker
    # stays in markers until it is done again)
    earlier = {u: markers[u] for u in packed_away}
    mine = units[c.task_index :: c.num_tasks]
    todo = [u for u in mine if u.name not in markers or markers[u.name]["failed"]]
    if packed_away or leftover:
        finished = stage.finished()
        if not todo and len(markers) == len(units) and finished and finished.get("packed"):
            # done, parts packed: what a deletion left after stats.json, then nothing
            fsio.rm_many([fsio.join(out, p) for p in leftover], METADATA_THREADS)
            return {**finished, "units_run": 0}
        # the dedups and the packing read every unit's parts: units whose parts were packed
        # and deleted are cleaned again with the others
        if packed_away:
            log.warning(
                "clean: %d units to clean again, and %d whose parts were packed with them",
                len(todo),
                len(packed_away),
            )
        gone = [marker_path(out, u) for u in packed_away]
        fsio.rm_many(gone, METADATA_THREADS)
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
    if c.num_tasks == 1 and sweep_temp_files(out):
        log.info("clean: removed the temp files of an interrupted earlier run")
    table = decontam.write_table(evals, c.decontam.n, out) if evals and todo else ""

    # made as each is handed out: a million units' jobs are not held at once
    def job(u: Unit) -> UnitJob:
        before = earlier.get(u.name) or markers.get(u.name)
        return UnitJob(u, c, out, filters, fingerprint, table, _files_of(out, before))

    jobs = _Jobs(todo, job)
    for m in _process(jobs, where):
        markers[m["unit"]] = m
    if all(u.name in markers for u in units):
        stats = finalize(stage, units, markers, filters, (files, skipped), where)
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


class _Jobs(Sequence[UnitJob]):
    """The UnitJob of each unit to do, made when asked for."""

    def __init__(self, units: list[Unit], make: Callable[[Unit], UnitJob]):
        self.units, self.make = units, make

    def __len__(self) -> int:
        return len(self.units)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self.make(u) for u in self.units[i]]
        return self.make(self.units[i])

    def __iter__(self) -> Iterator[UnitJob]:
        return map(self.make, self.units)


def _files_of(out: str, marker: dict | None) -> tuple[str, ...]:
    return marker_files(out, marker) if marker else ()


def _process(jobs: Sequence[UnitJob], where: Where) -> list[dict]:
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
