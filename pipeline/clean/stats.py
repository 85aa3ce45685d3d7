"""What `codex data clean` reports: the stats.json summary of its unit markers, and in words
why a clean kept little or nothing (the rule that dropped the most, and how to switch it off)."""

from __future__ import annotations

from codex.pipeline.readers import InputFile

PER_FILE_ROWS = 1000  # stats.json stays small on a corpus of a million files


def summarize(
    ms: list[dict], filters: list[str], files: list[InputFile], skipped: list[str]
) -> dict:
    """stats.json's counts from the unit markers `ms` (before the corpus-wide dedups)."""
    drops, drop_bytes, drop_kinds = _by_rule(ms)
    bad = [r for m in ms for r in m["bad_files"]]
    links = {r["path"]: r["skipped_link"] for r in bad if r.get("skipped_link")}
    rows = _per_file_rows(ms)
    return {
        "docs_in": sum(m["docs_in"] for m in ms),
        "bytes_in": sum(m["bytes_in"] for m in ms),
        "docs_out": sum(m["docs_kept"] for m in ms),
        "bytes_out": sum(m["bytes_kept"] for m in ms),
        "drops_total": sum(sum(v.values()) for v in drops.values()),
        "drops": drops,  # filter -> reason -> documents
        "drop_bytes": drop_bytes,  # filter -> reason -> input bytes
        "drop_kinds": drop_kinds,  # "filter:reason" -> input format -> input bytes
        "filters": filters,
        # per input file, kept before the corpus-wide dedup: the PER_FILE_ROWS files that kept
        # the smallest share of their bytes
        "per_file": rows[:PER_FILE_ROWS],
        "files": {
            "low_yield_files": sum(
                1 for r in rows if r["bytes_in"] and r["bytes_kept"] < 0.01 * r["bytes_in"]
            ),
            "inputs": len(files) - len(links),
            "skipped_unsupported": len(skipped),
            "first_skipped": skipped[:20],
            # links not read (InputFile.not_read): never documents, never an input read
            "skipped_links": len(links),
            "first_skipped_links": [{"path": p, "why": why} for p, why in list(links.items())[:20]],
        },
        "bad_input": _bad_input(bad),
        "units": len(ms),
        **_decontam(ms),
        **({"languages": langs} if (langs := _languages(ms)) else {}),
    }


def _decontam(ms: list[dict]) -> dict:
    """stats.json's "decontam": per eval set, the documents (and their input bytes) sharing an
    n-gram with it, dropped or marked in the units; {} when decontam did not run."""
    sets: dict[str, dict[str, int]] = {}
    for m in ms:
        for name, (docs, nbytes) in m.get("decontam", {}).items():
            row = sets.setdefault(name, {"docs": 0, "bytes": 0})
            row["docs"] += docs
            row["bytes"] += nbytes
    return {"decontam": sets} if sets else {}


def _languages(ms: list[dict]) -> dict:
    """data.clean.lang's counts summed: language -> documents and input bytes it was found in,
    documents and bytes kept in the units (before the corpus-wide dedups); most bytes first."""
    total: dict[str, list[int]] = {}
    for m in ms:
        for lang, counts in m.get("langs", {}).items():
            row = total.setdefault(lang, [0, 0, 0, 0])
            for i, n in enumerate(counts):
                row[i] += n
    keys = ("docs", "bytes", "docs_kept", "bytes_kept")
    ranked = sorted(total.items(), key=lambda kv: (-kv[1][1], kv[0]))
    return {lang: dict(zip(keys, row, strict=True)) for lang, row in ranked}


def _by_rule(ms: list[dict]) -> tuple[dict, dict, dict]:
    """The markers' drops summed: documents and input bytes (filter -> reason -> n), and input
    bytes per format ("filter:reason" -> format -> n)."""
    drops: dict[str, dict[str, int]] = {}
    drop_bytes: dict[str, dict[str, int]] = {}
    drop_kinds: dict[str, dict[str, int]] = {}
    for m in ms:
        for counts, into in ((m["drops"], drops), (m.get("drop_bytes", {}), drop_bytes)):
            for key, n in counts.items():
                flt, reason = key.split(":", 1)
                into.setdefault(flt, {})
                into[flt][reason] = into[flt].get(reason, 0) + n
        for key, kinds in m.get("drop_kinds", {}).items():
            total = drop_kinds.setdefault(key, {})
            for kind, n in kinds.items():
                total[kind] = total.get(kind, 0) + n
    return drops, drop_bytes, drop_kinds


def _per_file_rows(ms: list[dict]) -> list[dict]:
    """One row per input file, the files that kept the smallest share of their bytes first (ties
    by path)."""
    per_file: dict[str, list[int]] = {}
    for m in ms:  # a file cut into pieces is counted by several units
        for path, counts in m.get("per_file", {}).items():
            total = per_file.setdefault(path, [0, 0, 0, 0])
            for i, n in enumerate(counts):
                total[i] += n
    rows: list[dict] = [
        {"path": p, "docs_in": c[0], "bytes_in": c[1], "docs_kept": c[2], "bytes_kept": c[3]}
        for p, c in per_file.items()
    ]
    rows.sort(key=lambda r: (r["bytes_kept"] / max(r["bytes_in"], 1), r["path"]))
    return rows


def _bad_input(bad: list[dict]) -> dict:
    """stats.json's bad_input: the markers' file reports (FileReport) counted per problem."""

    def files_with(key):
        hit = [r for r in bad if r[key]]
        return {
            "files": len({r["path"] for r in hit}),
            "count": sum(int(r[key]) for r in hit),
            "first_files": [r["path"] for r in hit[:20]],
        }

    return {
        "failed_files": [
            {
                "path": r["path"],
                "error": r["error"],
                **({"link": True} if r.get("unreadable_link") else {}),
            }
            for r in bad
            if r["error"]
        ],
        "empty_files": files_with("empty"),
        "invalid_utf8_records": files_with("invalid_utf8_records"),
        "nul_chars": files_with("nul_chars"),
        "oversized_records": files_with("oversized_records"),
        "null_values": files_with("null_values"),
        # files that were one document each and were dropped whole (by length:too_long)
        "whole_files_dropped": [
            {"path": r["path"], "reason": r["dropped_whole"]} for r in bad if r.get("dropped_whole")
        ][:100],
        "malformed_lines": {
            "files": len({r["path"] for r in bad if r["malformed_lines"]}),
            "count": sum(r["malformed_lines"] for r in bad),
            "first": [
                {"path": r["path"], "lines": r["malformed_first"]}
                for r in bad
                if r["malformed_lines"]
            ][:20],
        },
    }


def top_drop(stats: dict) -> tuple[str, str, int] | None:
    """(filter, reason, documents) of the rule that dropped the most documents."""
    rows = [
        (flt, reason, n) for flt, reasons in stats["drops"].items() for reason, n in reasons.items()
    ]
    return max(rows, key=lambda r: r[2]) if rows else None


def rule_kinds(stats: dict, flt: str, reason: str) -> list[str]:
    """The input formats (text, jsonl, parquet) one rule dropped bytes from, most first; [] for
    the stats of a clean that did not count them."""
    kinds = stats.get("drop_kinds", {}).get(f"{flt}:{reason}", {})
    return sorted(kinds, key=lambda k: (-kinds[k], k))


# the rules for prose, which the code preset does not run (pipeline/clean/filters.py: PRESETS)
_PROSE_FILTERS = ("gopher_quality", "gopher_repetition", "c4", "fineweb")

# A rule's threshold setting (under data.clean.), which way to move it to keep more, and why a
# document fails it when that is no fault of the text
_THRESHOLDS = {
    ("gopher_quality", "below_alpha_threshold"): (
        "gopher_quality.max_non_alpha_words_ratio",
        "lower",
        "too few of its words hold a letter; spaced punctuation (WikiText's ' , ' and ' @-@ ') "
        "makes each mark a word",
    ),
    ("gopher_quality", "short_doc"): ("gopher_quality.min_doc_words", "lower", ""),
    ("gopher_quality", "not_enough_stop_words"): ("gopher_quality.min_stop_words", "lower", ""),
    ("length", "too_short"): ("length.min_chars", "lower", ""),
    ("c4", "too_few_sentences"): ("c4.min_num_sentences", "lower", ""),
    ("fineweb", "line_punct_ratio"): ("fineweb.line_punct_thr", "lower", ""),
    ("fineweb", "short_line_ratio"): ("fineweb.short_line_thr", "raise", ""),
    ("code", "long_line"): ("code.max_line_length", "raise", ""),
    ("code", "long_mean_line"): ("code.max_mean_line_length", "raise", ""),
    ("code", "low_alnum_fraction"): ("code.min_alnum_fraction", "lower", ""),
    ("lang", "low_score"): ("lang.min_score", "lower", ""),
    ("classifier", "low_score"): ("classifier.threshold", "lower", ""),
}


def _splits(key: str) -> str:
    """The two ways to split a text file into documents, for prose and for concatenated code
    files, set with `key` (--txt-delimiter, or a source's txt_delimiter:)."""
    return (
        f"{key} blank-lines for prose, or {key} 're:REGEX' for concatenated code files (a line "
        "the regex matches starts a document, e.g. 're:^// SPDX-License-Identifier')"
    )


def drop_fix(
    flt: str, reason: str, kinds: list[str] | tuple[str, ...] = (), sources: bool = False
) -> str:
    """How to stop one rule from dropping a document; its fixes in the order of `kinds`, the
    formats it dropped bytes from (rule_kinds): --txt-delimiter splits text files only.
    sources: said of a source of --sources, whose own keys (txt_delimiter, preset) come first."""
    if (flt, reason) == ("length", "too_long"):
        split = "a text file is one document unless split: " + (
            f"in its sources.yaml entry, {_splits('txt_delimiter:')}"
            if sources
            else "pass " + _splits("--txt-delimiter")
        )
        limits = "raise data.clean.length.max_chars / data.clean.max_record_bytes"
        if not kinds or kinds[0] == "text":
            return f"{split}, or {limits}"
        record = "a .jsonl line" if kinds[0] == "jsonl" else "a .parquet row"
        return f"{record} is one document: {limits}, or split such records before cleaning" + (
            f"; for the text files: {split}" if "text" in kinds else ""
        )
    if flt == "dedup":
        return "the documents are exact copies of each other"
    if flt == "decontam":
        return (
            f"the documents share an n-gram with eval set {reason}; to keep them with a "
            "`contaminated` column instead: --set data.clean.decontam.mode=mark"
        )
    off = f"switch that filter off with --set data.clean.{flt}.enabled=false"
    if flt == "lang" and reason != "low_score":  # the reason is the language found
        return f"the documents are in {reason}: add it to data.clean.lang.languages, or {off}"
    if flt in _PROSE_FILTERS:
        if sources:
            off += ", or in its sources.yaml entry preset: trusted for text you chose (a book)"
            off += " or preset: code for source code"
        else:
            off += ", or --preset trusted for text you chose (a book), --preset code for code"
    if (flt, reason) not in _THRESHOLDS:
        return off
    key, way, why = _THRESHOLDS[(flt, reason)]
    return f"{why + ': ' if why else ''}--set data.clean.{key}=<{way}>, or {off}"


def whole_files_dropped(stats: dict) -> str:
    """A warning naming the input files dropped whole (one document each, too long), with the
    switch that keeps them; "" when there is none."""
    whole = stats["bad_input"].get("whole_files_dropped") or []
    if not whole:
        return ""
    names = ", ".join(w["path"] for w in whole[:3]) + (" ..." if len(whole) > 3 else "")
    return (
        f"{len(whole)} input file(s) were one document each and were dropped whole by "
        f"length:too_long ({names}); split them into documents: {_splits('--txt-delimiter')} "
        "(or a source's txt_delimiter:); or raise data.clean.length.max_chars / "
        "data.clean.max_record_bytes"
    )


def low_yield(stats: dict, min_yield: float) -> bool:
    """Whether clean kept under `min_yield` of its input bytes (and kept something)."""
    return bool(stats["docs_out"]) and stats["bytes_out"] < min_yield * stats["bytes_in"]


def yield_problem(stats: dict) -> str:
    """In words: how little clean kept and which rules dropped the most."""
    rules = sorted(
        ((n, flt, reason) for flt, v in stats["drop_bytes"].items() for reason, n in v.items()),
        reverse=True,
    )[:3]
    most = ", ".join(f"{flt}:{reason} {n / 1e6:.1f} MB" for n, flt, reason in rules)
    flt, reason = rules[0][1], rules[0][2]
    fix = f"; fix for {flt}:{reason}: {drop_fix(flt, reason, rule_kinds(stats, flt, reason))}"
    whole = whole_files_dropped(stats)
    return (
        f"clean kept {100 * stats['bytes_out'] / max(stats['bytes_in'], 1):.2f}% of the input "
        f"bytes ({stats['bytes_out']} of {stats['bytes_in']}), under data.clean.min_yield="
        f"{stats['low_yield']}; the bytes went to {most}{fix}" + (f"; {whole}" if whole else "")
    )


def nothing_kept(stats: dict) -> str:
    top = top_drop(stats)
    empty = stats["bad_input"].get("empty_files") or {}
    named = (
        f"; {empty['files']} input file(s) empty ({', '.join(empty['first_files'][:3])})"
        if empty.get("count")
        else ""
    )
    if stats["docs_in"] == 0 or top is None:
        malformed = stats["bad_input"]["malformed_lines"]
        first = malformed["first"][0] if malformed["first"] else {"path": "", "lines": [""]}
        hint = (
            f"{malformed['count']} malformed lines, first: {first['path']} {first['lines'][0]}; "
            "choose the field with --text-field"
            if malformed["count"]
            else "the input files hold no text"
        )
        return f"no document was read ({hint}{named})"
    flt, reason, n = top
    return (
        f"{n} of {stats['docs_in']} documents dropped by {flt}:{reason}; "
        f"fix: {drop_fix(flt, reason, rule_kinds(stats, flt, reason))}{named}"
    )


def by_source(ms: list[dict], sources: list[dict]) -> list[dict]:
    """stats.json's "sources": per source (pipeline/inputs.py: clean_sources, whose keys each row
    keeps), what its files gave and kept in the units, before the corpus-wide dedups, and the
    rules that dropped its bytes, most first ("filter:reason" -> documents, input bytes)."""
    zero = {"docs_in": 0, "bytes_in": 0, "docs_kept": 0, "bytes_kept": 0}
    rows = {s["source"]: {**s, **zero} for s in sources}
    drops: dict[str, dict[str, list[int]]] = {name: {} for name in rows}
    for m in ms:
        for name, counts in unit_sources(m):
            row = rows.setdefault(
                name, {"source": name, "entry": False, "low_yield_allowed": False, **zero}
            )
            for k in zero:
                row[k] += counts[k]
            mine = drops.setdefault(name, {})
            for rule, (docs, nbytes) in counts["drops"].items():
                total = mine.setdefault(rule, [0, 0])
                total[0] += docs
                total[1] += nbytes
    for name, row in rows.items():
        ranked = sorted(drops[name].items(), key=lambda kv: (-kv[1][1], kv[0]))
        row["drops"] = {rule: d for rule, (d, _) in ranked}
        row["drop_bytes"] = {rule: b for rule, (_, b) in ranked}
    return list(rows.values())


def unit_sources(m: dict) -> list[tuple[str, dict]]:
    """(source, its counts in the unit) for each source of a unit's marker; a held marker of one
    source (plan.py: held) names it, and its own counts are that source's."""
    sources = m.get("per_source", {})
    if not isinstance(sources, str):
        return list(sources.items())
    drop_bytes = m.get("drop_bytes", {})
    drops = {rule: [n, drop_bytes.get(rule, 0)] for rule, n in m["drops"].items()}
    return [
        (
            sources,
            {
                **{k: m[k] for k in ("docs_in", "bytes_in", "docs_kept", "bytes_kept")},
                "drops": drops,
            },
        )
    ]


def _share(part: int, whole: int) -> str:
    return f"{100 * part / max(whole, 1):.1f}%"


def _size(n: int) -> str:
    """Bytes for people: 512 B, 19.4 KB, 1.10 MB, 3.2 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'MB' else 1}f} {unit}"
    return f"{n} B"


def source_summary(stats: dict, top: int = 3) -> list[str]:
    """The lines ending every clean: per source, documents and bytes in and kept, and the rules
    that dropped the most of its bytes, each with its share and its fix."""
    rows = stats.get("sources")
    if not rows:
        return []
    lines = ["summary by source (kept in the units, before the corpus-wide dedups):"]
    for row in rows:
        lines.append(
            f"  {row['source']}: documents {row['docs_in']} -> {row['docs_kept']}, bytes "
            f"{_size(row['bytes_in'])} -> {_size(row['bytes_kept'])} "
            f"({_share(row['bytes_kept'], row['bytes_in'])} kept)"
        )
        ranked = list(row["drop_bytes"].items())
        # the rules that took at least 1% of the source's bytes; the first in any case
        shown = ranked[:1] + [r for r in ranked[1:top] if r[1] * 100 >= row["bytes_in"]]
        for rule, nbytes in shown:
            flt, reason = rule.split(":", 1)
            lines.append(
                f"    dropped by {rule}: {row['drops'][rule]} documents, {_size(nbytes)} "
                f"({_share(nbytes, row['bytes_in'])}); fix: "
                f"{drop_fix(flt, reason, rule_kinds(stats, flt, reason), row['entry'])}"
            )
    if stats.get("decontam"):
        lines.append(
            "  decontamination, documents sharing an n-gram with each eval set: "
            + ", ".join(
                f"{k} {v['docs']} ({_size(v['bytes'])})" for k, v in stats["decontam"].items()
            )
        )
    langs = list(stats.get("languages", {}).items())
    if langs:  # data.clean.lang ran: the languages found, most bytes first
        lines.append(
            "  languages found (kept / found): "
            + ", ".join(
                f"{k} {v['docs_kept']}/{v['docs']} documents, {_size(v['bytes_kept'])}"
                for k, v in langs[: top + 3]
            )
            + (
                f" and {len(langs) - top - 3} more (stats.json: languages)"
                if len(langs) > top + 3
                else ""
            )
        )
    near = stats.get("near_dedup", {})
    cross = stats.get("dedup_across_units", 0) + near.get("url", 0) + near.get("minhash", 0)
    if cross:
        lines.append(f"  the corpus-wide dedups dropped {cross} more documents (copies)")
    return lines


def low_yield_sources(stats: dict, min_source_yield: float) -> list[str]:
    """The sources that kept under `min_source_yield` of their input bytes (and read some),
    unless allowed, worst first."""
    rows = [
        r
        for r in stats.get("sources", [])
        if r["bytes_in"]
        and r["bytes_kept"] < min_source_yield * r["bytes_in"]
        and not r["low_yield_allowed"]
    ]
    rows.sort(key=lambda r: (r["bytes_kept"] / r["bytes_in"], r["source"]))
    return [r["source"] for r in rows]


def source_yield_problem(stats: dict) -> str:
    """In words, one line: the source that kept the smallest share under
    data.clean.min_source_yield, its top rule and that rule's fix, the others named."""
    low = stats["low_source_yield"]
    rows = {r["source"]: r for r in stats["sources"]}
    row = rows[low["sources"][0]]
    text = (
        f"source {row['source']} kept {_share(row['bytes_kept'], row['bytes_in'])} of its bytes "
        f"({row['bytes_kept']} of {row['bytes_in']}), under data.clean.min_source_yield="
        f"{low['min']}"
    )
    if row["drop_bytes"]:
        rule, nbytes = next(iter(row["drop_bytes"].items()))
        flt, reason = rule.split(":", 1)
        text += (
            f"; {rule} took {_share(nbytes, row['bytes_in'])}; fix: "
            f"{drop_fix(flt, reason, rule_kinds(stats, flt, reason), row['entry'])}"
        )
    others = [rows[name] for name in low["sources"][1:]]
    if others:
        text += "; also under it: " + ", ".join(
            f"{r['source']} ({_share(r['bytes_kept'], r['bytes_in'])} kept"
            + (f", most by {next(iter(r['drop_bytes']))})" if r["drop_bytes"] else ")")
            for r in others[:3]
        )
        text += " ..." if len(others) > 3 else ""
    allow = (
        "allow_low_yield: true in its sources.yaml entry, or --allow-low-yield (every source)"
        if row["entry"]
        else "--allow-low-yield"
    )
    return f"{text}; if that is right, rerun with {allow}"
