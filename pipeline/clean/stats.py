"""What `codex data clean` reports: the stats.json summary of its unit markers, and in words
why a clean kept little or nothing (the rule that dropped the most, and how to switch it off)."""

from __future__ import annotations

from pipeline.readers import InputFile


def summarize(
    ms: list[dict], filters: list[str], files: list[InputFile], skipped: list[str]
) -> dict:
    drops: dict[str, dict[str, int]] = {}
    for m in ms:
        for key, n in m["drops"].items():
            flt, reason = key.split(":", 1)
            drops.setdefault(flt, {})
            drops[flt][reason] = drops[flt].get(reason, 0) + n
    bad = [r for m in ms for r in m["bad_files"]]

    def files_with(key):
        hit = [r for r in bad if r[key]]
        return {
            "files": len({r["path"] for r in hit}),
            "count": sum(int(r[key]) for r in hit),
            "first_files": [r["path"] for r in hit[:20]],
        }

    return {
        "docs_in": sum(m["docs_in"] for m in ms),
        "bytes_in": sum(m["bytes_in"] for m in ms),
        "docs_out": sum(m["docs_kept"] for m in ms),
        "bytes_out": sum(m["bytes_kept"] for m in ms),
        "drops_total": sum(sum(v.values()) for v in drops.values()),
        "drops": drops,  # filter -> reason -> documents
        "filters": filters,
        "files": {
            "inputs": len(files),
            "skipped_unsupported": len(skipped),
            "first_skipped": skipped[:20],
        },
        "bad_input": {
            "failed_files": [{"path": r["path"], "error": r["error"]} for r in bad if r["error"]],
            "empty_files": files_with("empty"),
            "invalid_utf8_records": files_with("invalid_utf8_records"),
            "nul_chars": files_with("nul_chars"),
            "oversized_records": files_with("oversized_records"),
            "null_values": files_with("null_values"),
            "malformed_lines": {
                "files": len({r["path"] for r in bad if r["malformed_lines"]}),
                "count": sum(r["malformed_lines"] for r in bad),
                "first": [
                    {"path": r["path"], "lines": r["malformed_first"]}
                    for r in bad
                    if r["malformed_lines"]
                ][:20],
            },
        },
        "units": len(ms),
    }


def top_drop(stats: dict) -> tuple[str, str, int] | None:
    """(filter, reason, documents) of the rule that dropped the most documents."""
    rows = [
        (flt, reason, n) for flt, reasons in stats["drops"].items() for reason, n in reasons.items()
    ]
    return max(rows, key=lambda r: r[2]) if rows else None


def drop_fix(flt: str, reason: str) -> str:
    """How to stop one rule from dropping a document."""
    if (flt, reason) == ("length", "too_long"):
        return (
            "a text file is one document unless split: pass --txt-delimiter '\\n\\n' "
            "(blank lines), or raise data.clean.length.max_chars / data.clean.max_record_bytes"
        )
    if flt == "dedup":
        return "the documents are exact copies of each other"
    return (
        f"switch that filter off with --set data.clean.{flt}.enabled=false, or use --preset code "
        "for source code"
    )


def nothing_kept(stats: dict) -> str:
    top = top_drop(stats)
    if stats["docs_in"] == 0 or top is None:
        malformed = stats["bad_input"]["malformed_lines"]
        hint = (
            f"{malformed['count']} malformed lines, first: {malformed['first'][0]['lines'][0]}; "
            "choose the field with --text-field"
            if malformed["count"]
            else "the input files hold no text"
        )
        return f"no document was read ({hint})"
    flt, reason, n = top
    return (
        f"{n} of {stats['docs_in']} documents dropped by {flt}:{reason}; "
        f"fix: {drop_fix(flt, reason)}"
    )
