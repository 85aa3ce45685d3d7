"""`codex data shard` over several cleaned runs (data.shard.sources: {name: RUN}): each source's
clean/ is sharded into OUT/name/ by the one-source stage (its own manifest, resume and checks),
then OUT/manifest.json lists every source's shards with their "source" and the tokens per source,
so the loader can draw by weight (train/data/mixture.py). docs/stages.md, "Several sources".
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

from codex.core import fsio, rundir
from codex.core.config import Config
from codex.pipeline.inputs import clean_parts
from codex.pipeline.shard.errors import ShardError
from codex.pipeline.shard.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    PROGRESS,
    SPLITS,
    existing_state,
    mismatch,
)
from codex.pipeline.stage import Stage

log = logging.getLogger("codex.shard")

# the keys every source's manifest shares (one tokenizer, one set of shard settings)
SHARED = ("tokenizer", "special_ids", "dtype", "append_eos", "val_fraction", "shard_tokens")


def run_sources(cfg: Config, run_one: Callable[[Config, list[str]], dict]) -> dict:
    """Shard each source of data.shard.sources with `run_one` (the one-source stage: a config
    whose data.shard.out is OUT/name, and the source's cleaned parts), then write the manifest of
    them all; returns it."""
    s = cfg.data.shard
    out = s.out or rundir.shards_dir(cfg.run)
    stage = Stage("codex data shard", cfg, out, MANIFEST, error=ShardError)
    settings = {"format_version": FORMAT_VERSION, "sources": dict(s.sources)}
    state = existing_state(out)
    if state is not None:
        diff = mismatch(state.get("settings") or {}, settings)
        if diff:
            stage.refuse(
                f"holds shards made from other sources ({'; '.join(diff)})",
                f"remove {out} or pass another --out",
            )
    parts = {}
    for name, run in s.sources.items():
        try:
            parts[name] = clean_parts(run)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"data.shard.sources.{name}: {e}") from None
    stage.start()
    fsio.write_json(fsio.join(out, PROGRESS), {"settings": settings})
    manifests = {}
    for name, files in parts.items():
        sub = copy.deepcopy(cfg)
        sub.data.shard.sources, sub.data.shard.out = {}, fsio.join(out, name)
        log.info("shard: source %s (%s, %d cleaned parts)", name, s.sources[name], len(files))
        manifests[name] = run_one(sub, files)
    manifest = combined_manifest(manifests, settings)
    stage.commit(manifest)
    for name, m in manifest["sources"].items():
        log.info(
            "shard: source %s: %d train / %d val tokens",
            name,
            m["tokens"]["train"],
            m["tokens"]["val"],
        )
    return manifest


def combined_manifest(manifests: dict[str, dict], settings: dict) -> dict:
    """One manifest of the sources' manifests (in the order given): their entries with the path
    under the source's folder and its "source", totals added up, and per source its tokens,
    documents and shards per split."""
    first = next(iter(manifests.values()))
    for name, m in manifests.items():
        for key in SHARED:
            if m.get(key) != first.get(key):
                raise RuntimeError(f"shard: source {name} has another {key}: internal error")
    entries = [
        {**e, "path": f"{name}/{e['path']}", "source": name}
        for name, m in manifests.items()
        for e in m["shards"]
    ]
    per_source = {
        name: {
            "tokens": {sp: m["totals"][sp]["tokens"] for sp in SPLITS},
            "documents": {sp: m["totals"][sp]["documents"] for sp in SPLITS},
            "shards": {sp: m["totals"][sp]["shards"] for sp in SPLITS},
        }
        for name, m in manifests.items()
    }
    totals = {
        sp: {k: sum(m["totals"][sp][k] for m in manifests.values()) for k in first["totals"][sp]}
        for sp in SPLITS
    }
    settings = {
        **settings,
        "per_source": {name: m.get("settings", {}) for name, m in manifests.items()},
    }
    return {
        "format_version": FORMAT_VERSION,
        **{key: first[key] for key in SHARED},
        "shards": entries,
        "totals": totals,
        "sources": per_source,
        "settings": settings,
    }
