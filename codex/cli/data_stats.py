"""`codex data stats`: the cleaned corpus's histograms (pipeline/clean/report.py), a command of
its own module (main.py adds it to `codex data`)."""

from __future__ import annotations

import click

from codex.cli.command import UserError, config_options, stage
from codex.core.config import build_config


@click.command("stats")
@click.argument("run_dir", metavar="RUN", required=False)
@config_options
@stage
def data_stats(run_dir, run, config_file, overrides):
    """Histograms of the cleaned corpus (characters and words per document, kept vs dropped, score
    columns) in RUN/clean/stats/stats.json and stats.png, and the rule that dropped most bytes.

    The dropped documents' histograms need a clean run with --keep-rejected.

    \b
    Example:
      codex data stats --run runs/web
    """
    if run_dir and run and run_dir.rstrip("/") != run.rstrip("/"):
        raise UserError(f"two run directories: RUN={run_dir} and --run {run}; give one")
    cfg = build_config(config_file, overrides, run=run_dir or run)
    from codex.core import fsio, rundir
    from codex.pipeline.clean.report import corpus_stats

    r = corpus_stats(cfg.run)
    groups = r["groups"]
    click.echo(
        f"{groups['kept']['docs']} kept and {groups['dropped']['docs']} dropped documents -> "
        f"{fsio.join(rundir.clean_dir(cfg.run), 'stats')}/stats.json, stats.png"
    )
    top = r["top_rule_by_bytes"]
    if top:
        click.echo(
            f"most bytes dropped by {top['rule']}: {top['docs']} documents, {top['bytes']} bytes "
            f"({100 * top['share_of_input_bytes']:.1f}% of the input)"
        )
    if "note" in r:
        click.echo(f"note: {r['note']}")
