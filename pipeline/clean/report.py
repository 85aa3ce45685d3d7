"""`codex data stats`: distributions of a cleaned corpus, to tune thresholds by looking at them.

Reads RUN/clean's parts (and rejected/ when clean ran with --keep-rejected) one row group at a
time and writes RUN/clean/stats/stats.json and stats.png: histograms of document length in
characters and in words, kept vs dropped (and per filter that dropped), of the Gopher rules'
signals, of every float column the rows hold (a score in 0..1), and the rule that dropped the
most bytes (from clean's stats.json).
"""

from __future__ import annotations

import io
import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from codex.core import fsio, rundir
from codex.core.config import ConfigError
from codex.core.progress import Progress
from codex.pipeline.clean.words import word_counts
from codex.pipeline.inputs import ls_matching

log = logging.getLogger("codex.stats")

# log-spaced edges, 4 bins a decade: 0, 1, 1.8, 3.2, 5.6, 10, ... (the last bin takes what is over)
CHAR_EDGES = np.concatenate([[0.0], np.logspace(0, 7, 29)])
WORD_EDGES = np.concatenate([[0.0], np.logspace(0, 6, 25)])
SCORE_EDGES = np.linspace(0, 1, 21)  # a float column (a language or classifier score)
# the rule signals computed from the text (Gopher's words: pipeline/clean/words.py), the rules'
# settings being what people tune: their bins
SIGNAL_EDGES = {
    "avg_word_length": np.linspace(0, 20, 41),  # gopher_quality min/max_avg_word_length
    "alpha_words_ratio": np.linspace(0, 1, 21),  # gopher_quality max_non_alpha_words_ratio
    "stop_words": np.arange(0, 10),  # gopher_quality min_stop_words (distinct; 8 and over last)
    "dup_line_frac": np.linspace(0, 1, 21),  # gopher_repetition dup_line_frac
}


def signals(text: str) -> tuple[float, float, float, float]:
    """(mean word length, fraction of words holding a letter, distinct stop words, fraction of
    duplicate lines) of one document, as the Gopher rules compute them."""
    n_words, n_real, real_chars, n_alpha, n_stop = word_counts(text)
    lines = [line for line in text.split("\n") if line]
    return (
        real_chars / n_real if n_real else 0.0,
        n_alpha / n_words if n_words else 0.0,
        float(n_stop),
        (len(lines) - len(set(lines))) / len(lines) if lines else 0.0,
    )


class Histograms:
    """Counts of one group of documents (kept, dropped, dropped by one filter) in fixed bins, so
    row groups add up."""

    def __init__(self) -> None:
        self.docs = 0
        self.chars = np.zeros(len(CHAR_EDGES) - 1, dtype=np.int64)
        self.words = np.zeros(len(WORD_EDGES) - 1, dtype=np.int64)
        self.scores: dict[str, np.ndarray] = {}
        self.signals = {k: np.zeros(len(e) - 1, dtype=np.int64) for k, e in SIGNAL_EDGES.items()}

    def add(self, table: pa.Table) -> None:
        text = table.column("text")
        self.docs += len(text)
        self.chars += _hist(pc.utf8_length(text), CHAR_EDGES)
        self.words += _hist(pc.list_value_length(pc.utf8_split_whitespace(text)), WORD_EDGES)
        values = np.array([signals(t or "") for t in text.to_pylist()]).reshape(-1, 4)
        for (name, edges), column in zip(SIGNAL_EDGES.items(), values.T, strict=True):
            self.signals[name] += _hist(pa.array(column), edges)
        for name, column in zip(table.column_names, table.columns, strict=True):
            if pa.types.is_floating(column.type):
                counts = self.scores.setdefault(name, np.zeros(len(SCORE_EDGES) - 1, np.int64))
                counts += _hist(column, SCORE_EDGES)

    def as_json(self) -> dict:
        return {
            "docs": self.docs,
            "chars": self.chars.tolist(),
            "words": self.words.tolist(),
            "signals": {k: v.tolist() for k, v in self.signals.items()},
            **({"scores": {k: v.tolist() for k, v in self.scores.items()}} if self.scores else {}),
        }


def _hist(values, edges: np.ndarray) -> np.ndarray:
    """Counts of values in the bins of edges; below the first and over the last: in those bins;
    nulls left out."""
    v = pc.drop_null(values).to_numpy(zero_copy_only=False).astype(np.float64)
    return np.histogram(np.clip(v, edges[0], edges[-1]), bins=edges)[0]


def _row_groups(path: str, columns: list[str] | None = None):
    with fsio.open(path, "rb") as fh:
        pf = pq.ParquetFile(fh)
        for i in range(pf.num_row_groups):
            yield pf.read_row_group(i, columns=columns)


def _scan(paths: list[str], groups: dict[str, Histograms], rejected: bool, label: str) -> None:
    """Add every row group of these parts to groups["kept"], or (rejected rows) to
    groups["dropped"] and groups["dropped:<filter>"]."""
    with Progress(f"stats ({label})", total=len(paths), unit="parts") as progress:
        for path in paths:
            for table in _row_groups(path):
                progress.update(0, docs=table.num_rows, bytes=table.nbytes)
                if not rejected:
                    groups["kept"].add(table)
                    continue
                groups["dropped"].add(table)
                filters = np.array([r.split(":", 1)[0] for r in table.column("reason").to_pylist()])
                for flt in np.unique(filters):
                    mask = pa.array(filters == flt)
                    groups.setdefault(f"dropped:{flt}", Histograms()).add(table.filter(mask))
            progress.update(1)


def top_rule(clean_stats: dict) -> dict | None:
    """The rule that dropped the most input bytes (clean's stats.json), with its documents."""
    rows = [
        (n, flt, reason)
        for flt, reasons in clean_stats.get("drop_bytes", {}).items()
        for reason, n in reasons.items()
    ]
    if not rows:
        return None
    n, flt, reason = max(rows)
    return {
        "rule": f"{flt}:{reason}",
        "bytes": n,
        "docs": clean_stats["drops"][flt][reason],
        "share_of_input_bytes": n / max(clean_stats["bytes_in"], 1),
    }


def corpus_stats(run: str) -> dict:
    """Write RUN/clean/stats/stats.json and stats.png; return what stats.json holds."""
    out = rundir.clean_dir(run)
    path = fsio.join(out, "stats.json")
    if not fsio.exists(path):
        raise ConfigError(f"{path} not found: run `codex data clean --run {run}` first")
    clean_stats = fsio.read_json(path)
    groups: dict[str, Histograms] = {"kept": Histograms(), "dropped": Histograms()}
    _scan([fsio.join(out, s) for s in clean_stats["shards"]], groups, False, "kept")
    rejected = ls_matching(fsio.join(out, "rejected"), "*.parquet")
    _scan(rejected, groups, True, "rejected")
    top = top_rule(clean_stats)
    report: dict = {
        "run": run,
        "edges": {
            "chars": CHAR_EDGES.tolist(),
            "words": WORD_EDGES.tolist(),
            "scores": SCORE_EDGES.tolist(),
            "signals": {k: v.tolist() for k, v in SIGNAL_EDGES.items()},
        },
        "groups": {name: g.as_json() for name, g in groups.items()},
        "top_rule_by_bytes": top,
        "drop_bytes": {
            f"{flt}:{reason}": n
            for flt, reasons in clean_stats.get("drop_bytes", {}).items()
            for reason, n in reasons.items()
        },
    }
    if not rejected:
        report["note"] = (
            "no rejected rows (clean ran without --keep-rejected): the histograms are of the kept "
            "documents only; rerun clean with --keep-rejected for the dropped ones"
        )
    folder = fsio.join(out, "stats")
    fsio.write_json(fsio.join(folder, "stats.json"), report)
    with fsio.atomic_open(fsio.join(folder, "stats.png"), "wb") as fh:
        fh.write(_plot(groups, top))
    return report


def _plot(groups: dict[str, Histograms], top: dict | None) -> bytes:
    """The PNG: top row, characters and words per document (kept, dropped, each filter's drops)
    and each score column; bottom row, the rule signals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = sorted({k for g in groups.values() for k in g.scores})
    cols = max(2 + len(scores), len(SIGNAL_EDGES))
    fig, axes = plt.subplots(2, cols, figsize=(5 * cols, 8), squeeze=False)
    panels = [("chars", CHAR_EDGES, True), ("words", WORD_EDGES, True)]
    panels += [(f"score:{k}", SCORE_EDGES, False) for k in scores]
    rows = [panels, [(f"signal:{k}", e, False) for k, e in SIGNAL_EDGES.items()]]
    for row, row_panels in enumerate(rows):
        for col in range(cols):
            ax = axes[row][col]
            if col >= len(row_panels):
                ax.axis("off")
                continue
            what, edges, log_x = row_panels[col]
            for name, g in groups.items():
                counts = _counts(g, what)
                if g.docs and counts is not None:
                    style = "--" if name == "dropped" else "-"  # the sum of the dropped:<filter>
                    x = np.maximum(edges, 0.5) if log_x else edges
                    ax.stairs(counts, x, label=f"{name} ({g.docs})", ls=style)
            if log_x:
                ax.set_xscale("log")
            ax.set_xlabel(what.split(":")[-1] + (" per document" if log_x else ""))
            ax.set_ylabel("documents")
            ax.legend(fontsize=7)
    title = "cleaned corpus"
    if top:
        title += f"; most bytes dropped by {top['rule']} ({100 * top['share_of_input_bytes']:.1f}%)"
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


def _counts(g: Histograms, what: str) -> np.ndarray | None:
    if what.startswith("score:"):
        return g.scores.get(what[6:])
    if what.startswith("signal:"):
        return g.signals[what[7:]]
    return g.chars if what == "chars" else g.words
