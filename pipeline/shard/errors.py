"""The shard stage's two errors: a command line `codex data shard` cannot run (ShardError, exit
2), and damaged input (ShardDataError, exit 1). Raised by every module of the stage."""

from __future__ import annotations

from codex.core.config import ConfigError


class ShardError(ConfigError):
    """A command line `codex data shard` cannot run (missing tokenizer or corpus, impossible
    settings, an output of other settings). Exit 2."""


class ShardDataError(ValueError):
    """Damaged input for `codex data shard` (a cleaned part that cannot be read, a tokenizer.json
    that does not match its meta). Exit 1, like every stage's bad data."""
