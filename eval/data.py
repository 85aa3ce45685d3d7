"""`codex eval --data`: any text, read and normalised as `codex data clean` reads it, encoded with
the run's tokenizer by the shard stage's Encoder into one temporary val shard + manifest, so the
exact windowing and rank split of train/loader.val_batches apply unchanged.
"""

from __future__ import annotations

import logging
import tempfile
from typing import cast

import numpy as np

from codex.core import fsio, rundir
from codex.pipeline.clean.filters import normalize
from codex.pipeline.encode import Encoder, token_dtype
from codex.pipeline.inputs import list_inputs
from codex.pipeline.readers import FileReport, read_records
from codex.pipeline.shard.manifest import FORMAT_VERSION, MANIFEST
from codex.pipeline.shard.write import write_shard
from codex.pipeline.tokenizer.tokenizer import load_tokenizer

log = logging.getLogger("codex.eval")


def tokenize_to_shard(
    cfg, run_cfg, data_run: str, data_paths: list[str], max_tokens: int, seq_len: int, backend
):
    """Read, normalise and tokenize `data_paths` with the run's tokenizer into one temporary npy
    shard + manifest, so the exact windowing and rank split of train/loader.val_batches apply
    unchanged.

    "Cleaning" here is the clean stage's text normalisation (NFC, newlines, control characters) and
    dropping empty documents, not its quality filters: the user chose this held-out text, and a
    number on a filtered subset of it would not be the number they asked for. Documents are encoded
    by `codex data shard`'s Encoder (<|bos|> + tokens (+ <|eos|> when the run's shards have it)) and
    the shard file is written by the stage's own write_shard (pipeline/shard/write.py). Every rank
    tokenizes the same text (deterministic) and keeps its own copy. Returns (shards_dir,
    TemporaryDirectory, documents).

    7 parameters: what run_eval has resolved for it (both configs, the run holding the tokenizer
    and shards: train.data_run or RUN, the paths, the token budget, the length, the backend); its
    one caller."""
    tok = load_tokenizer(rundir.tokenizer_dir(data_run))
    manifest_path = fsio.join(rundir.shards_dir(data_run), "manifest.json")
    append_eos = (
        fsio.read_json(manifest_path).get("append_eos", False)
        if fsio.exists(manifest_path)
        else run_cfg.data.shard.append_eos
    )
    dtype = token_dtype(run_cfg.model.vocab_size)
    encoder = Encoder(
        tok.to_str(),
        cast(int, tok.token_to_id("<|bos|>")),  # every codex tokenizer has its specials
        cast(int, tok.token_to_id("<|eos|>")),
        append_eos,
        dtype,
        run_cfg.data.shard.chunk_chars,
    )
    files, skipped = list_inputs(data_paths, cfg.data.clean.text_extensions)
    if not files:
        raise FileNotFoundError(
            f"--data {' '.join(data_paths)}: no readable text files"
            + (f" (skipped {len(skipped)} of another type, e.g. {skipped[0]})" if skipped else "")
        )
    if skipped and backend.is_main:
        log.warning(
            "--data: skipped %d files of an unsupported type (e.g. %s)", len(skipped), skipped[0]
        )
    budget = max_tokens + 1 if max_tokens > 0 else None
    parts, documents = _encode_data_files(
        files, cfg.data.clean, encoder, encoder.load(), budget, backend.is_main
    )
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    if budget is not None:
        tokens = tokens[:budget]
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"--data {' '.join(data_paths)}: {len(tokens)} tokens in {documents} documents, "
            "fewer than "
            f"one window of seq_len + 1 = {seq_len + 1} tokens"
        )
    tmp = tempfile.TemporaryDirectory(prefix="codex-eval-data-")
    bos_count = int(np.count_nonzero(tokens == encoder.bos))
    entries = write_shard(tmp.name, "val", 0, tokens, bos_count, ["npy"])
    fsio.write_json(
        fsio.join(tmp.name, MANIFEST),
        {
            "format_version": FORMAT_VERSION,
            "dtype": dtype,
            "append_eos": append_eos,
            "shards": entries,
        },
    )
    return tmp.name, tmp, documents


def _encode_data_files(
    files, clean_cfg, encoder, tok, budget: int | None, is_main: bool
) -> tuple[list, int]:
    """(encoded batches, documents) of normalised non-empty documents, until `budget` tokens."""
    parts: list[np.ndarray] = []
    pending: list[str] = []
    total, documents, empty, oversized = 0, 0, 0, 0

    def flush():
        nonlocal total
        flat, _ = encoder.encode(tok, pending)
        parts.append(flat)
        total += len(flat)
        pending.clear()

    for f in files:
        report = FileReport(f.path)
        for rec in read_records(f, clean_cfg, report):
            if rec.text is None:
                oversized += 1
                continue
            text, _ = normalize(rec.text)
            if not text:
                empty += 1
                continue
            pending.append(text)
            documents += 1
            if len(pending) >= 256:
                flush()
            if budget is not None and total >= budget:
                break
        if report.bad() and is_main:
            log.warning("--data %s: %s", f.path, report.error or report.describe())
        if budget is not None and total >= budget:
            break
    if pending:
        flush()
    if (oversized or empty) and is_main:
        log.warning(
            "--data: %d documents used, %d empty after normalisation and %d over "
            "data.clean.max_record_bytes skipped",
            documents,
            empty,
            oversized,
        )
    return parts, documents
