"""`codex data tokenize`: train a byte-level BPE tokenizer on the cleaned corpus.

    RUN/clean/part-*.parquet
      -> pass 1: tasks hash every document and send the driver only keys under a hash threshold
      -> pass 2: tasks read the selected documents; the driver streams them into the BPE trainer
      -> RUN/tokenizer/ tokenizer.json, token_bytes.npy, config.yaml, tokenizer_meta.json (last)

Where the passes run changes nothing: the same input files give the same tokenizer.json byte for
byte. Compression is measured on held-out documents, never trained on. The tokenizer and its
trainers: pipeline/tokenizer/bpe.py; which documents: pipeline/tokenizer/doc_select.py.
docs/stages.md, "tokenize", has the details.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import resource
import sys
import time

import numpy as np
from tokenizers import Tokenizer

from codex.core import fsio, rundir
from codex.core.config import Config, ConfigError
from codex.pipeline.encode import token_dtype
from codex.pipeline.executor import Where, stage_pool, where_for
from codex.pipeline.inputs import input_files
from codex.pipeline.readers import iter_text_batches
from codex.pipeline.stage import Stage
from codex.pipeline.tokenizer.bpe import (
    MIN_VOCAB,
    RUSTBPE_MAX_BYTES,
    SPECIAL_IDS,
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    token_bytes_of,
    train_tokenizer,
)
from codex.pipeline.tokenizer.doc_select import (
    Selection,
    TextReader,
    iter_selected,
    select_documents,
)

log = logging.getLogger("codex.tokenize")

COMPRESSION_MAX_CHARS = 2_000_000  # held-out text encoded to measure bytes/token

TOKENIZER_FILE = "tokenizer.json"
TOKEN_BYTES_FILE = "token_bytes.npy"
META_FILE = rundir.TOKENIZER_META
FORMAT_VERSION = 1


def compression(tok: Tokenizer, texts: list[str], max_chars: int = COMPRESSION_MAX_CHARS) -> dict:
    """Bytes per token of `texts` (UTF-8 bytes / tokens, no specials), on at most `max_chars`.

    Why a cap: encoding the held-out documents whole would cost a large share of a small run's
    tokenizer training, and 2M characters already give a stable ratio.
    """
    each = max(max_chars // max(len(texts), 1), 1)
    texts = [t[:each] for t in texts]
    if not texts:
        return {"bytes_per_token": None, "docs": 0, "bytes": 0, "tokens": 0}
    tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    return {
        "bytes_per_token": round(nbytes / max(tokens, 1), 4),
        "docs": len(texts),
        "bytes": nbytes,
        "tokens": tokens,
    }


# --- the stage ----------------------------------------------------------------------------------


def _settings(cfg: Config) -> dict:
    t = cfg.data.tokenizer
    return {
        "vocab_size": t.vocab_size,
        "max_chars": t.max_chars,
        "doc_max_chars": t.doc_max_chars,
        "heldout_docs": t.heldout_docs,
        "trainer": t.trainer,
        "split_pattern": SPLIT_PATTERN,
        "format_version": FORMAT_VERSION,
    }


def _validate(cfg: Config) -> None:
    t = cfg.data.tokenizer
    if t.vocab_size < MIN_VOCAB:
        raise ConfigError(
            f"data.tokenizer.vocab_size={t.vocab_size}: must be at least {MIN_VOCAB} "
            f"({len(SPECIAL_TOKENS)} specials + 256 bytes)"
        )
    if t.vocab_size >= 2**32:
        raise ConfigError(f"data.tokenizer.vocab_size={t.vocab_size}: must be below 2**32")
    for key in ("max_chars", "doc_max_chars"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"data.tokenizer.{key}={getattr(t, key)}: must be positive")
    if t.heldout_docs < 0:
        raise ConfigError(f"data.tokenizer.heldout_docs={t.heldout_docs}: must be >= 0")


def _peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS. It is this process's peak so far.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)


def _input_keys(inputs: list[dict], from_clean: bool) -> list[tuple[str, int]]:
    """What identifies the input files across a moved or copied run: the cleaned parts by name and
    size (their folder is RUN/clean wherever RUN is), files named in data.tokenizer.inputs by
    path."""
    return [(fsio.basename(i["path"]) if from_clean else i["path"], i["bytes"]) for i in inputs]


def _up_to_date(out: str, settings: dict, inputs: list[dict], from_clean: bool) -> dict | None:
    """The existing meta when RUN/tokenizer was made from the same settings and input files."""
    meta_path = fsio.join(out, META_FILE)
    if not fsio.exists(meta_path):
        return None
    try:
        meta = fsio.read_json(meta_path)
        same = meta.get("settings") == settings and _input_keys(
            meta.get("inputs") or [], from_clean
        ) == _input_keys(inputs, from_clean)
        if (
            same
            and hashlib.sha256(fsio.read_bytes(fsio.join(out, TOKENIZER_FILE))).hexdigest()
            == meta["sha256"]
            and fsio.exists(fsio.join(out, TOKEN_BYTES_FILE))
        ):
            return meta
    except (ValueError, KeyError, FileNotFoundError):
        pass  # unreadable or partial: train again
    return None


def file_sizes(paths: list[str]) -> list[int]:
    """Each file's bytes, in order; on an object store, where each is a request, 16 at a time."""
    return fsio.map_requests(fsio.size, paths, fsio.request_threads(paths))


def _text_reader(cfg: Config) -> TextReader:
    """How to read the training files: the cleaned parts have a "text" column; files named in
    data.tokenizer.inputs are read with the field/column the clean stage would use for them."""
    if not cfg.data.tokenizer.inputs:
        return iter_text_batches
    c = cfg.data.clean
    return functools.partial(iter_text_batches, text_field=c.text_field, text_column=c.text_column)


def run_tokenizer(cfg: Config) -> dict:
    """Train the tokenizer for cfg.run and write RUN/tokenizer/; returns tokenizer_meta.json's dict.

    A rerun with the same settings and input files returns the existing result without training;
    one that would replace a tokenizer that shards or checkpoints were made with is refused.
    """
    _validate(cfg)
    t = cfg.data.tokenizer
    where = where_for(cfg.data, t.workers, run=cfg.run)
    t0 = time.perf_counter()
    stage = Stage(
        "codex data tokenize",
        cfg,
        rundir.tokenizer_dir(cfg.run),
        META_FILE,
        later=(rundir.shards_dir(cfg.run), rundir.checkpoints_dir(cfg.run)),
    )
    files = input_files(cfg)
    sizes = file_sizes(files)
    inputs = [{"path": f, "bytes": n} for f, n in zip(files, sizes, strict=True)]
    settings = _settings(cfg)
    done = _up_to_date(stage.out, settings, inputs, from_clean=not t.inputs)
    if done is not None:
        log.info(
            "tokenizer in %s is up to date (vocab %d, sha256 %s); nothing to do",
            stage.out,
            done["vocab_size"],
            done["sha256"][:12],
        )
        return done
    # Retraining would give the later stages' token ids another meaning without a word.
    stage.refuse_if_built_on(
        "would be retrained (its settings or inputs changed)"
        if fsio.exists(stage.marker_path)
        else "would be trained (it holds no finished tokenizer)"
    )

    read = _text_reader(cfg)
    # one pool of local processes (or one attached Ray driver) for both passes
    with stage_pool(where) as where:
        sel = _select(files, t, read, where, sizes)
        t_scan = time.perf_counter() - t0
        heldout: list[str] = []
        # rustbpe's buffer: ~64M characters of documents at a time (memory), at least 64
        # (parallelism).
        buffer_docs = max(64, min(8192, 64_000_000 // t.doc_max_chars))
        tok = train_tokenizer(
            iter_selected(files, sel, t.doc_max_chars, heldout, read, where),
            t.vocab_size,
            trainer=t.trainer,
            buffer_docs=buffer_docs,
        )
    t_train = time.perf_counter() - t0 - t_scan
    _check_specials(tok, t.vocab_size)
    tok.encode_special_tokens = True  # compression of plain text: "<|bos|>" in a document is text
    comp = _measure_compression(tok, heldout, files, sel, t, read)
    text = tok.to_str(pretty=True)
    meta = _meta(
        tok,
        text,
        t,
        sel,
        comp,
        len(files),
        settings,
        inputs,
        {
            "scan": round(t_scan, 2),
            "train": round(t_train, 2),
            "total": round(time.perf_counter() - t0, 2),
        },
    )
    _write_tokenizer(stage, tok, text, meta)
    return meta


def _write_tokenizer(stage: Stage, tok: Tokenizer, text: str, meta: dict) -> None:
    """RUN/tokenizer/: tokenizer.json (text), token_bytes.npy, then tokenizer_meta.json (the
    stage's commit); logs the result."""
    stage.start()
    fsio.write_text(fsio.join(stage.out, TOKENIZER_FILE), text)
    buf = io.BytesIO()
    np.save(buf, token_bytes_of(tok))
    fsio.write_bytes(fsio.join(stage.out, TOKEN_BYTES_FILE), buf.getvalue())
    stage.commit(meta)
    comp = meta["compression"]
    log.info(
        "tokenize: vocab %d, %.2f bytes/token on %d %s docs, peak RSS %.0f MB, %.1fs -> %s",
        meta["vocab_size"],
        comp["bytes_per_token"] or 0,
        comp["docs"],
        comp["sample"],
        meta["peak_rss_mb"],
        meta["seconds"]["total"],
        stage.out,
    )


def _select(files: list[str], t, read: TextReader, where: Where, sizes: list[int]) -> Selection:
    """Pass 1 (which documents train), refusing a selection that cannot train."""
    log.info(
        "tokenize: %d input files, vocab %d, budget %d chars, scan on %s",
        len(files),
        t.vocab_size,
        t.max_chars,
        "ray" if where.executor == "ray" else f"{where.workers} local process(es)",
    )
    sel = select_documents(files, t.max_chars, t.doc_max_chars, t.heldout_docs, read, where, sizes)
    if sel.train_docs == 0:
        raise ValueError(
            f"no training text: {sel.docs_seen} non-empty documents in {len(files)} files "
            f"and none fits data.tokenizer.max_chars={t.max_chars}"
        )
    log.info(
        "tokenize: training on %d of %d documents (%d chars, %d capped at %d chars), %d held out",
        sel.train_docs,
        sel.docs_seen,
        sel.train_chars,
        sel.docs_capped,
        t.doc_max_chars,
        sel.heldout_docs,
    )
    if t.trainer == "rustbpe" and sel.train_bytes > RUSTBPE_MAX_BYTES:
        raise ConfigError(
            "data.tokenizer.trainer=rustbpe counts in 32-bit integers: "
            f"at most {RUSTBPE_MAX_BYTES:,} "
            f"bytes of training text, and data.tokenizer.max_chars={t.max_chars:,} selected "
            f"{sel.train_bytes:,}; lower max_chars or set data.tokenizer.trainer=hf"
        )
    return sel


def _check_specials(tok: Tokenizer, requested: int) -> None:
    for i in SPECIAL_IDS.values():
        got = tok.token_to_id(SPECIAL_TOKENS[i])
        if got != i:
            raise RuntimeError(f"special token {SPECIAL_TOKENS[i]} got id {got}, expected {i}")
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size < requested:
        log.warning(
            "tokenize: the corpus only supports %d tokens (asked for %d): no pair left to merge; "
            "meta records vocab_size=%d",
            vocab_size,
            requested,
            vocab_size,
        )


def _measure_compression(
    tok: Tokenizer, heldout: list[str], files: list[str], sel: Selection, t, read: TextReader
) -> dict:
    if heldout:
        return {**compression(tok, heldout), "sample": "heldout"}
    if t.heldout_docs == 0:
        return {**compression(tok, []), "sample": "none"}
    # fewer than 10 documents, none could be held out: measure on (tiny) training text, say so
    log.warning(
        "tokenize: %d documents, too few to hold any out; compression measured on training text",
        sel.docs_seen,
    )
    # read here, in file order: the first training documents, whatever ran the passes
    train_only = Selection(train=sel.train, train_docs=sel.train_docs)
    sample = list(iter_selected(files, train_only, t.doc_max_chars, [], read, Where()))
    return {**compression(tok, sample[: t.heldout_docs]), "sample": "training"}


def _meta(
    tok: Tokenizer,
    text: str,
    t,
    sel: Selection,
    comp: dict,
    n_files: int,
    settings: dict,
    inputs: list[dict],
    seconds: dict,
) -> dict:
    """tokenizer_meta.json: the contract later stages check (sha256, vocab, specials) and the
    record.

    9 parameters: one per part of the record it assembles; run_tokenizer, its one caller, has each
    at hand."""
    # imported here: importlib.metadata is ~15 ms of the start of every process that imports this
    # module (shard's workers load tokenizers through it), and only a finished training needs it
    from importlib.metadata import version

    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    return {
        "format_version": FORMAT_VERSION,
        "vocab_size": vocab_size,
        "vocab_size_requested": t.vocab_size,
        "token_dtype": token_dtype(vocab_size),
        "special_ids": dict(SPECIAL_IDS),
        "special_tokens": {name: SPECIAL_TOKENS[i] for name, i in SPECIAL_IDS.items()},
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "split_pattern": SPLIT_PATTERN,
        "corpus": {
            "fingerprint": sel.fingerprint,
            "files": n_files,
            "docs_seen": sel.docs_seen,
            "docs_empty": sel.docs_empty,
            "docs_capped": sel.docs_capped,
            "chars_seen": sel.chars_seen,
            "docs_used": sel.train_docs,
            "chars_used": sel.train_chars,
            "bytes_used": sel.train_bytes,
            "heldout_docs": sel.heldout_docs,
        },
        "chars_used": sel.train_chars,
        "compression": comp,
        "peak_rss_mb": _peak_rss_mb(),
        "seconds": seconds,
        "trainer": t.trainer,
        "tokenizers_version": version("tokenizers"),
        **({"rustbpe_version": version("rustbpe")} if t.trainer == "rustbpe" else {}),
        "settings": settings,
        "inputs": inputs,
    }


# --- loading ------------------------------------------------------------------------------------


def load_meta(tokenizer_dir: str) -> dict:
    path = fsio.join(tokenizer_dir, META_FILE)
    if not fsio.exists(path):
        raise FileNotFoundError(
            f"{path} not found: {tokenizer_dir} is not a finished tokenizer "
            f"(run `codex data tokenize`)"
        )
    meta = fsio.read_json(path)
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    return meta


def load_tokenizer(tokenizer_dir: str) -> Tokenizer:
    """The trained tokenizer, checked against its meta, with encode_special_tokens=True.

    encode_special_tokens is not saved in tokenizer.json, and without it a literal "<|bos|>" inside
    a document would become a fake document boundary; with it, such text is encoded as plain bytes
    and special ids only ever come from code that inserts them on purpose.
    """
    meta = load_meta(tokenizer_dir)
    path = fsio.join(tokenizer_dir, TOKENIZER_FILE)
    data = fsio.read_bytes(path)
    digest = hashlib.sha256(data).hexdigest()
    if digest != meta["sha256"]:
        raise ValueError(
            f"{path}: sha256 {digest[:12]} does not match {META_FILE} ({meta['sha256'][:12]}); "
            f"the tokenizer was modified or half-rewritten: rerun `codex data tokenize`"
        )
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{path}: not a readable tokenizer ({_first_line(e)})") from None
    tok.encode_special_tokens = True
    if tok.get_vocab_size(with_added_tokens=True) != meta["vocab_size"]:
        raise ValueError(
            f"{path}: vocab size {tok.get_vocab_size()} != {META_FILE} "
            f"vocab_size {meta['vocab_size']}"
        )
    return tok


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_token_bytes(tokenizer_dir: str) -> np.ndarray:
    """int32 [vocab_size]: UTF-8 bytes of each token, 0 for specials."""
    path = fsio.join(tokenizer_dir, TOKEN_BYTES_FILE)
    if not fsio.exists(path):
        raise FileNotFoundError(f"{path} not found (run `codex data tokenize`)")
    arr = np.load(io.BytesIO(fsio.read_bytes(path)), allow_pickle=False)
    if arr.ndim != 1 or arr.dtype != np.int32:
        raise ValueError(f"{path}: expected int32 [vocab_size], got {arr.dtype} {arr.shape}")
    return arr
