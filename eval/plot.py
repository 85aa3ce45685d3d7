"""A PNG of training and validation loss against tokens seen, from RUN/metrics.jsonl.

    path = plot_loss("runs/demo")    # -> runs/demo/eval/loss.png

metrics.jsonl holds one JSON object a line, {"kind": "train"|"val", "step", "tokens", "loss", ...}.
A resumed run appends the steps after its checkpoint again, so for each (kind, step) the LAST line
wins. A run killed mid-write can leave a torn last line: that one is skipped with a warning; a bad
line anywhere else is an error naming the file and line.

matplotlib (Agg, no display needed) draws it; the figure object is used directly instead of pyplot
so nothing global is touched.
"""

from __future__ import annotations

import io
import json
import logging

from codex.core import fsio, rundir

log = logging.getLogger("codex.eval")


def read_metrics(path: str) -> list[dict]:
    """The metrics log as a list of dicts, in file order (a torn last line is skipped)."""
    if not fsio.exists(path):
        raise FileNotFoundError(f"{path}: no metrics log; run `codex train` first")
    lines = fsio.read_text(path).splitlines()
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):
                log.warning("%s line %d: torn last line skipped (%s)", path, i, e.msg)
                continue
            raise ValueError(f"{path} line {i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {i}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def loss_curves(
    rows: list[dict], path: str = "metrics.jsonl"
) -> dict[str, list[tuple[float, float]]]:
    """{"train": [(tokens, loss), ...], "val": [...]}, sorted by tokens, last line per step wins."""
    latest: dict[str, dict] = {"train": {}, "val": {}}
    for i, row in enumerate(rows, start=1):
        kind = row.get("kind")
        if kind not in latest or "loss" not in row:
            continue  # other kinds (e.g. run info) and rows without a loss are not plotted
        for key in ("tokens", "step"):
            if not isinstance(row.get(key), (int, float)):
                raise ValueError(
                    f"{path} row {i}: a {kind} row needs a numeric '{key}', got {row.get(key)!r}"
                )
        latest[kind][row["step"]] = (float(row["tokens"]), float(row["loss"]))
    return {kind: sorted(by_step.values()) for kind, by_step in latest.items()}


def plot_loss(run: str) -> str:
    """Draw RUN/eval/loss.png (train and val loss vs tokens seen); returns its path."""
    metrics = rundir.metrics_path(run)
    curves = loss_curves(read_metrics(metrics), metrics)
    if not curves["train"] and not curves["val"]:
        raise ValueError(f"{metrics}: no train or val rows with a loss to plot")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if curves["train"]:
        t, loss = zip(*curves["train"], strict=True)
        ax.plot(t, loss, label="train", color="tab:blue", linewidth=1.2, alpha=0.85)
    if curves["val"]:
        t, loss = zip(*curves["val"], strict=True)
        ax.plot(t, loss, label="val", color="tab:orange", marker="o", markersize=3.5, linewidth=1.5)
        ax.annotate(
            f"{loss[-1]:.3f}",
            (t[-1], loss[-1]),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=8,
            color="tab:orange",
        )
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"codex: {run.rstrip('/').rsplit('/', 1)[-1]}")
    ax.xaxis.set_major_formatter(_tokens_formatter())
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    out = fsio.join(rundir.eval_dir(run), "loss.png")
    fsio.makedirs(rundir.eval_dir(run))
    fsio.write_bytes(out, buf.getvalue())
    return out


def _tokens_formatter():
    from matplotlib.ticker import FuncFormatter

    def fmt(x, _pos):
        for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
            if abs(x) >= div:
                return f"{x / div:g}{unit}"
        return f"{x:g}"

    return FuncFormatter(fmt)
