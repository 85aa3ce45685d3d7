"""`codex data shard`: the cleaned corpus -> fixed-size token shards + manifest.json (the commit
marker).

This module is the stage: its settings and checks (the tokenizer, an output made with other
settings, a finished output whose shards all still match), its three phases (scan.py, encode.py,
write.py, each run through pipeline/executor/), and the manifest. The documents and their splits
are read in corpus.py; the stage's errors are in errors.py. The shards depend only on the clean
files, the tokenizer and the shard settings. The phases, determinism, resume, memory:
docs/stages.md (shard).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging

from codex.core import fsio, rundir
from codex.core.config import Config
from codex.pipeline.encode import token_dtype
from codex.pipeline.executor import Where, check_executor, run_units, slots, stage_pool, where_for
from codex.pipeline.inputs import clean_parts
from codex.pipeline.readers import forget_row_group
from codex.pipeline.shard.encode import (
    EncodeUnit,
    encode_phase,
    encode_units,
    shard_load_encoder,
)
from codex.pipeline.shard.errors import ShardDataError, ShardError
from codex.pipeline.shard.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    PROGRESS,
    SHARD_MARKERS,
    SPLITS,
    UNITS,
    build_manifest,
    existing_state,
    file_matches,
    mismatch,
    per_path,
    remove_temp_files,
    small_val_split,
)
from codex.pipeline.shard.scan import scan_corpus
from codex.pipeline.shard.sources import run_sources
from codex.pipeline.shard.write import WriteSettings, write_phase
from codex.pipeline.stage import Stage
from codex.pipeline.tokenizer.tokenizer import load_meta, load_tokenizer

log = logging.getLogger("codex.shard")

# --workers 0: one process per this much cleaned corpus at most, in parquet bytes (the parts' sizes,
# zstd: ~4-5x less than their text for code, ~3x for prose); one process already encodes on every
# core (the encoder's threads), so below it a second process's start costs more than it gains
# (README's stage table)
AUTO_BYTES_PER_WORKER = 4 << 20


# --- settings, tokenizer --------------------------------------------------------------------------


def _inputs_fingerprint(sizes: dict[str, int]) -> str:
    """The cleaned parts' names and sizes (path -> bytes)."""
    h = hashlib.sha256()
    for f, size in sizes.items():
        h.update(f"{f.rsplit('/', 1)[-1]}\t{size}\n".encode())
    return h.hexdigest()


def _dtype_for(vocab_size: int, requested: str, where: str) -> str:
    """data.shard.dtype checked against the vocabulary; "auto" is encode.token_dtype's choice."""
    if requested == "auto":
        return token_dtype(vocab_size)
    if requested == "uint16" and token_dtype(vocab_size) != "uint16":
        raise ShardError(
            f"data.shard.dtype=uint16 cannot hold vocab_size {vocab_size} of {where} "
            f"(uint16 holds ids < 65536): use dtype=uint32 or auto"
        )
    return requested


def _validate(cfg: Config) -> None:
    s = cfg.data.shard
    if s.shard_tokens < 2:
        raise ShardError(
            f"data.shard.shard_tokens must be >= 2 (a window needs 2 tokens), got {s.shard_tokens}"
        )
    if not 0 < s.val_fraction < 1:
        raise ShardError(f"data.shard.val_fraction must be in (0, 1), got {s.val_fraction}")
    if s.workers < 0:
        raise ShardError(f"data.shard.workers must be >= 0 (0: auto), got {s.workers}")
    if s.chunk_chars < 1000:
        raise ShardError(f"data.shard.chunk_chars must be >= 1000, got {s.chunk_chars}")


def _load_tokenizer(tok_dir: str):
    if not fsio.exists(fsio.join(tok_dir, "tokenizer.json")):
        raise ShardError(
            f"no tokenizer: {tok_dir}/tokenizer.json not found (run `codex data tokenize` first)"
        )
    try:
        meta = load_meta(tok_dir)
        tok = load_tokenizer(tok_dir)
    except FileNotFoundError as e:
        raise ShardError(str(e)) from None
    except ValueError as e:  # sha256 / vocab mismatch between tokenizer.json and its meta
        raise ShardDataError(str(e)) from None
    ids = meta["special_ids"]
    for name in ("bos", "eos"):
        token = f"<|{name}|>"
        if tok.token_to_id(token) != ids[name]:
            raise ShardError(
                f"{tok_dir}: {token} has id {tok.token_to_id(token)} "
                f"but tokenizer_meta.json says {ids[name]}"
            )
    return tok, meta


def _settings(cfg: Config, meta: dict, dtype: str, inputs_sha: str) -> dict:
    """Everything the shard bytes depend on: a rerun with other settings must not mix outputs."""
    s = cfg.data.shard
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer_sha256": meta["sha256"],
        "vocab_size": meta["vocab_size"],
        "dtype": dtype,
        "shard_tokens": s.shard_tokens,
        "val_fraction": s.val_fraction,
        "append_eos": s.append_eos,
        "format": s.format,
        "chunk_chars": s.chunk_chars,
        "inputs_sha256": inputs_sha,
    }


def _refuse_other_settings(stage: Stage, settings: dict) -> None:
    """An existing output (manifest or started run) must come from the same settings: never mix two
    runs in one folder."""
    state = existing_state(stage.out)
    if state is None:
        return
    diff = mismatch(state.get("settings") or {}, settings)
    if diff:
        what = (
            "another tokenizer"
            if any(d.startswith("tokenizer_sha256") for d in diff)
            else "other settings"
        )
        stage.refuse(
            f"holds shards made with {what} ({'; '.join(diff)})",
            f"remove {stage.out} or pass another --out",
        )


# --- the stage ------------------------------------------------------------------------------------


def shard_check_unit(unit: tuple[str, str]) -> bool:
    return file_matches(*unit)


def _check_shards(out: str, manifest: dict, where: Where) -> tuple[list[dict], list[str]]:
    """(the manifest's entries whose files still match their sha256, what is wrong with the
    others)."""
    entries: dict[tuple[str, str], dict] = {}
    bad = []
    for e in manifest.get("shards", []):
        try:
            path = fsio.join_inside(out, e["path"], f"{fsio.join(out, MANIFEST)}: a shard path")
        except ValueError as err:
            bad.append(str(err))
            continue
        entries[(path, e["sha256"])] = e
    good = []
    for unit, ok in run_units(shard_check_unit, list(entries), where):
        if ok:
            good.append(entries[unit])
        else:
            bad.append(f"{unit[0]} is missing or changed")
    return good, bad


def _encode_template(
    units_dir: str, cfg: Config, meta: dict, dtype: str, fingerprint: str
) -> EncodeUnit:
    """What every encode unit of this run shares (no part yet)."""
    s = cfg.data.shard
    return EncodeUnit(
        -1,
        "",
        units_dir,
        fsio.join(rundir.tokenizer_dir(cfg.run), "tokenizer.json"),
        meta["sha256"],
        meta["special_ids"]["bos"],
        meta["special_ids"]["eos"],
        s.append_eos,
        dtype,
        s.chunk_chars,
        s.val_fraction,
        fingerprint,
    )


def run_shard(cfg: Config, files: list[str] | None = None) -> dict:
    """Tokenize RUN/clean (or these cleaned parts) into shards under cfg.data.shard.out (default
    RUN/shards); returns the manifest. With data.shard.sources, each source's (sources.py)."""
    s = cfg.data.shard
    if s.sources and files is None:
        return run_sources(cfg, run_shard)
    _validate(cfg)
    check_executor(cfg.data)
    stage = Stage(
        "codex data shard", cfg, s.out or rundir.shards_dir(cfg.run), MANIFEST, error=ShardError
    )
    out = stage.out
    units_dir = fsio.join(out, UNITS)
    tok_dir = rundir.tokenizer_dir(cfg.run)
    _, meta = _load_tokenizer(tok_dir)
    dtype = _dtype_for(meta["vocab_size"], s.dtype, tok_dir)
    files = clean_parts(cfg.run) if files is None else files
    sizes = dict(zip(files, per_path(fsio.size, files), strict=True))  # a request a part on GCS
    where = where_for(cfg.data, s.workers, sum(sizes.values()), AUTO_BYTES_PER_WORKER, run=cfg.run)
    settings = _settings(cfg, meta, dtype, _inputs_fingerprint(sizes))
    formats: list[str] = ["npy", "parquet"] if s.format == "both" else [s.format]
    _refuse_other_settings(stage, settings)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    template = _encode_template(units_dir, cfg, meta, dtype, fingerprint)

    # --workers N: one pool of N processes for every phase; they load the encoder while this
    # process checks or scans
    with stage_pool(where, functools.partial(shard_load_encoder, template)) as where:
        previous: list[dict] = []
        manifest = stage.finished()
        if manifest is not None:
            previous, bad = _check_shards(out, manifest, where)
            if not bad:
                log.info(
                    "shard: %s is complete and every shard matches its sha256; nothing to do", out
                )
                # left when a run was killed right after its commit
                fsio.rm(units_dir, recursive=True)
                return manifest
            for problem in bad:
                log.warning("shard: %s; redoing it", problem)

        scanned = scan_corpus(files, s.val_fraction, where)  # fails fast on an impossible split
        stage.start()  # a damaged or unfinished output has no manifest
        fsio.write_json(fsio.join(out, PROGRESS), {"settings": settings})
        remove_temp_files(out)

        units = encode_units(files, scanned, slots(where), template)
        markers = encode_phase(units, where)
        w = WriteSettings(
            s.shard_tokens, dtype, formats, out, fsio.join(units_dir, SHARD_MARKERS), fingerprint
        )
        shards = write_phase(units, markers, w, previous, where)
    forget_row_group()  # this process's last row group (readers/parquet.py), up to 64 MB
    docs = {sp: sum(m["documents"][sp] for m in markers) for sp in SPLITS}
    manifest = build_manifest(shards, settings, meta, dtype, s, docs)
    remove_temp_files(out)  # a write task retried after its worker died may have left one
    stage.commit(manifest)
    fsio.rm(units_dir, recursive=True)
    _log_totals(manifest, out)
    return manifest


def _log_totals(manifest: dict, out: str) -> None:
    per_split = ", ".join(
        f"{sp} {t['tokens']} tokens / {t['documents']} docs / {t['shards']} shards"
        for sp, t in ((sp, manifest["totals"][sp]) for sp in SPLITS)
    )
    log.info("shard: %s -> %s", per_split, out)
    small = small_val_split(manifest, out)
    if small:
        log.warning("shard: %s", small)
