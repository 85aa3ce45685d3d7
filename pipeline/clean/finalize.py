"""The end of clean, once every unit is done: the corpus-wide dedups (pipeline/clean/dedup.py,
near_dedup.py), stats.json (the stage's commit), packing the parts (pack.py), sweeping temp files,
the warnings, and the refusal of a corpus later stages must not take (refuse_bad_outcome).
"""

from __future__ import annotations

import logging

from codex.core import fsio
from codex.pipeline.clean import near_dedup
from codex.pipeline.clean.dedup import dedup_corpus
from codex.pipeline.clean.pack import pack_parts
from codex.pipeline.clean.plan import METADATA_THREADS, Unit
from codex.pipeline.clean.stats import (
    by_source,
    drop_fix,
    low_yield,
    low_yield_sources,
    nothing_kept,
    rule_kinds,
    source_yield_problem,
    summarize,
    top_drop,
    whole_files_dropped,
    yield_problem,
)
from codex.pipeline.executor import Where
from codex.pipeline.inputs import clean_sources, ls_matching
from codex.pipeline.stage import Stage

log = logging.getLogger("codex.clean")


class CleanError(RuntimeError):
    """Some input files could not be used; everything else was cleaned (see stats.json)."""


def finalize(
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
    if all("per_source" in m for m in ordered):  # markers of an older clean have none
        stats["sources"] = by_source(ordered, clean_sources(c))
        low = low_yield_sources(stats, c.min_source_yield)
        if low:  # as low_yield: refused until a rerun allows them
            stats["low_source_yield"] = {"min": c.min_source_yield, "sources": low}
    replaced: list[str] = []
    # a corpus to use: its units' parts packed. One refused (failed files, low yield, nothing
    # kept) keeps its units' parts, for the rerun that redoes some units or allows it.
    if usable(stats):
        stats["shards"], replaced = pack_parts(stage, ordered, where)
        stats["packed"] = bool(replaced)
    if c.num_tasks == 1:  # what killed unit attempts left (a Ray retry): one listing a folder
        sweep_temp_files(stage.out)  # (none on an object store)
    stage.commit(stats)
    # once stats.json lists the packed parts, the units' own are not needed
    fsio.rm_many([fsio.join(stage.out, p) for p in replaced], METADATA_THREADS)
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


def usable(stats: dict) -> bool:
    """Whether a finished clean's corpus is one later stages take (refuse_bad_outcome)."""
    failed = stats["bad_input"]["failed_files"]
    return (
        not failed
        and stats["docs_out"] > 0
        and not stats.get("low_yield")
        and not stats.get("low_source_yield")
    )


def refuse_bad_outcome(stats: dict, out: str) -> None:
    """Exit 1 for a run whose outputs are written but must not pass silently: failed input files,
    nothing kept, under 1% kept, or a source under data.clean.min_source_yield (without
    --allow-low-yield)."""
    failed = stats["bad_input"]["failed_files"]
    if failed:
        links = any(f.get("link") for f in failed)
        raise CleanError(
            f"{len(failed)} input file(s) failed, the rest was cleaned (see {out}/stats.json): "
            + "; ".join(f["error"] for f in failed[:3])
            + (
                "; to skip links that lead nowhere, rerun with "
                "--set data.clean.skip_unreadable_links=true (only their units are redone)"
                if links
                else ""
            )
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
    if stats.get("low_source_yield"):
        raise CleanError(f"{out}: {source_yield_problem(stats)} (only the dedup pass runs again)")


def sweep_temp_files(out: str) -> int:
    """Remove the temp files of writes a killed run left anywhere in the clean folder (its parts,
    hash files, markers, dedup files, stats). Only for a run that is the folder's one writer: the
    tasks of a job array write it together. None on an object store: a write there is one upload,
    whole or absent (fsio.atomic_open), so there is nothing to list for."""
    if fsio.is_remote(out):
        return 0
    gone = 0
    for sub in ("", "rejected", "hashes", "markers", "dedup", "minhash", "near"):
        for path in ls_matching(fsio.join(out, sub) if sub else out, ".tmp-*"):
            fsio.rm(path)
            gone += 1
    return gone


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
    links = stats["files"]["first_skipped_links"]
    if links:
        log.warning(
            "clean: %d input link(s) not read (files.first_skipped_links in stats.json): %s",
            stats["files"]["skipped_links"],
            "; ".join(f"{e['path']}: {e['why']}" for e in links[:3])
            + (" ..." if len(links) > 3 else ""),
        )
    whole = whole_files_dropped(stats)
    if whole:
        log.warning("clean: %s", whole)
    starved = stats["files"]["low_yield_files"]
    if starved:
        under = [
            e for e in stats["per_file"] if e["bytes_in"] and e["bytes_kept"] < 0.01 * e["bytes_in"]
        ]
        worst = ", ".join(
            f"{e['path']} ({100 * e['bytes_kept'] / e['bytes_in']:.1f}%)" for e in under[:3]
        ) + (" ..." if starved > 3 else "")
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
            drop_fix(top[0], top[1], rule_kinds(stats, top[0], top[1])),
        )
