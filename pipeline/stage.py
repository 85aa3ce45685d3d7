"""The run-directory contract of a data stage (clean, tokenize, shard), owned in one place.

Every stage writes one folder of RUN (codex/core/rundir.py) through a `Stage`: finished() (its
completion marker), refuse() and refuse_if_built_on() (exit 2 with one line saying how to start
over), start() (remove the old marker first, so a killed run is never "done") and commit()
(config.yaml, then the marker, last). What is "done" below the marker and how a killed run
resumes stay with each stage. ARCHITECTURE.md, "Data stages", has the details.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from codex.core import fsio
from codex.core.config import Config, ConfigError, save_config

log = logging.getLogger("codex.stage")


@dataclass
class Stage:
    command: str  # "codex data shard", for messages
    cfg: Config
    out: str  # the stage's folder (RUN/clean, RUN/tokenizer, RUN/shards)
    marker: str  # completion marker's file name inside `out`, written last
    later: tuple[str, ...] = ()  # folders of later stages built from this output
    error: type[ConfigError] = ConfigError

    @property
    def marker_path(self) -> str:
        return fsio.join(self.out, self.marker)

    def finished(self) -> dict | None:
        """The completion marker's contents, None when the stage has not finished here."""
        return fsio.read_json(self.marker_path) if fsio.exists(self.marker_path) else None

    def refuse(self, holds: str, fix: str) -> None:
        raise self.error(f"{self.out} {holds}; {fix}")

    def built_on(self) -> list[str]:
        """The later stages' folders that hold output (a manifest, or any file)."""
        return [
            d
            for d in self.later
            if fsio.exists(fsio.join(d, "manifest.json")) or (fsio.isdir(d) and fsio.listdir(d))
        ]

    def refuse_if_built_on(self, why: str) -> None:
        """Refuse to rewrite `out` (for `why`) when a later stage's output was built from it."""
        built = self.built_on()
        if built:
            later = " and ".join(built)
            raise self.error(
                f"{self.out} {why}, but {later} were built from it; to start over "
                f"use a new --run, or delete {later} and {self.out} first"
            )

    def start(self) -> None:
        fsio.makedirs(self.out)
        fsio.rm(self.marker_path)

    def commit(self, marker: dict) -> None:
        save_config(self.cfg, fsio.join(self.out, "config.yaml"))
        fsio.with_retries(lambda: fsio.write_json(self.marker_path, marker), self.marker_path)
