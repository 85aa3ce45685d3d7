"""The shard stage's second phase, encode: the cleaned parts -> each encode unit's token streams in
.units/ (the folder's layout: manifest.py).

A unit is rows [start, stop) of one part. With fewer than UNITS_PER_WORKER x slots parts, the
parts are cut at the scan's sampled rows into ranges of about equal bytes, so that no core idles
(_cuts). A unit writes per split its token stream and tokens per document, then its marker; a
rerun skips the units whose marker matches (_encoded). How a document is encoded is
pipeline/encode.py's; here, which documents, in what order, on how many threads.
docs/stages.md, "An encode unit", has the details.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field, replace

import numpy as np

from codex.core import fsio
from codex.core.progress import Progress
from codex.pipeline.encode import Encoder, EncodeWith
from codex.pipeline.executor import Where, cores, run_units, worker_id
from codex.pipeline.shard.corpus import read_text_rows, split_value_bytes
from codex.pipeline.shard.errors import ShardError
from codex.pipeline.shard.manifest import SPLITS, UNIT_DONE, read_markers

log = logging.getLogger("codex.shard")

BATCH_CHARS = 4_000_000  # text per encode call: big enough for the thread pool, small for memory
# encode units per unit of parallelism (local worker or Ray CPU) when the parts are fewer: the
# parts are then cut into byte-balanced row ranges, so that no core idles while another encodes
# the last big part
UNITS_PER_WORKER = 4
# the last `slots` of those units are cut in pieces that halve this many times (_cuts): a slot that
# finishes early takes the next, smaller one, and the slots finish within a small piece of each
# other (a unit costs a few ms beyond its encoding: its process keeps the row group it read last)
TAIL_HALVINGS = 3


# --- the units: what one holds, where the parts are cut -------------------------------------------


@dataclass
class EncodeUnit:
    """Rows [start, stop) of one part to encode, with everything a worker process or Ray task needs
    (picklable)."""

    index: int  # the part's place in corpus order
    path: str
    units_dir: str
    tokenizer_path: str
    tokenizer_sha256: str
    bos: int
    eos: int
    append_eos: bool
    dtype: str
    chunk_chars: int
    val_fraction: float
    fingerprint: str  # of the settings: a marker of other settings is not this unit's
    start: int = 0  # the part's rows [start, stop)
    stop: int = 0
    documents: dict[str, int] = field(default_factory=dict)  # in those rows per split (the scan's)
    threads: int = 0  # encoder threads of the process that runs it; 0: leave them alone

    @property
    def folder(self) -> str:
        """NNNNN-PART-rows-START-STOP: a rerun that cuts the parts elsewhere (other --workers)
        never takes another range's files for this one's."""
        name = fsio.basename(self.path).removesuffix(".parquet")
        return fsio.join(self.units_dir, f"{self.index:05d}-{name}-rows-{self.start}-{self.stop}")

    def file(self, name: str) -> str:
        return fsio.join(self.folder, name)


def _cuts(scans: list[dict], slots: int) -> list[list[int]]:
    """Where each part is cut into encode units (rows, from 0 to its row count). Each part is one
    unit when the parts are at least UNITS_PER_WORKER x slots (or nothing runs side by side);
    otherwise the corpus is cut at the scan's sampled rows into that many ranges of about equal
    UTF-8 bytes, the last `slots` of them in `slots` pieces of 1/2, 1/4, ... 1/2**TAIL_HALVINGS
    their size and `slots` more of the last size (units start in the list's order), so that every
    slot has work until the end and the slots finish together."""
    whole = [[0, r["rows"]] for r in scans]
    want = UNITS_PER_WORKER * slots
    total = sum(int(r["bytes_at"][-1]) for r in scans)
    if slots <= 1 or len(scans) >= want or total == 0:
        return whole
    # where units end, in the corpus's bytes (0 and total left out)
    ends = np.linspace(0, total, want + 1)
    halves = [2.0**-k for k in range(1, TAIL_HALVINGS + 1)] + [2.0**-TAIL_HALVINGS]
    tail = ends[-slots - 1] + np.cumsum([0, *np.repeat(halves, slots)]) * (total / want)
    goals = np.concatenate([ends[1 : -slots - 1], tail[:-1]])
    cuts = []
    offset = 0
    for r in scans:
        at, rows = r["bytes_at"], r["rows_at"]
        size = int(at[-1])
        mine = goals[(goals > offset) & (goals < offset + size)] - offset
        offset += size
        i = np.clip(np.searchsorted(at, mine), 1, len(at) - 1)
        i -= mine - at[i - 1] < at[i] - mine  # the nearer of the two sampled rows
        cut = sorted({0, r["rows"], *rows[i].tolist()})
        cuts.append(cut if len(cut) > 1 else [0, 0])  # an empty part is one (empty) unit
    return cuts


def encode_units(
    files: list[str], scanned: dict[str, dict], slots: int, template: EncodeUnit
) -> list[EncodeUnit]:
    """The encode units in corpus order (see _cuts), each with the documents the scan counted in
    its rows."""
    scans = [scanned[f] for f in files]
    units = []
    for i, (f, r, cut) in enumerate(zip(files, scans, _cuts(scans, slots), strict=True)):
        rows, val_at = r["rows_at"], r["val_at"]
        for a, b in zip(cut, cut[1:], strict=False):
            val = int(val_at[np.searchsorted(rows, b)] - val_at[np.searchsorted(rows, a)])
            documents = {"train": b - a - val, "val": val}
            units.append(replace(template, index=i, path=f, start=a, stop=b, documents=documents))
    if len(units) > len(files):
        log.info(
            "shard: %d parts cut into %d encode units of ~%.1f MB (%d run side by side)",
            len(files),
            len(units),
            sum(int(r["bytes_at"][-1]) for r in scans) / len(units) / 1e6,
            slots,
        )
    return units


# --- encoding a unit ------------------------------------------------------------------------------


# one tokenizer per process, loaded by its first unit
_encoders: dict[tuple, tuple[Encoder, EncodeWith]] = {}


def _encoder_for(u: EncodeUnit) -> tuple[Encoder, EncodeWith]:
    key = (u.tokenizer_sha256, u.bos, u.eos, u.append_eos, u.dtype, u.chunk_chars)
    if key not in _encoders:
        data = fsio.read_bytes(u.tokenizer_path)
        if hashlib.sha256(data).hexdigest() != u.tokenizer_sha256:
            raise ShardError(
                f"{u.tokenizer_path} changed while shards were being made from it: rerun "
                "`codex data shard` once `codex data tokenize` has finished"
            )
        encoder = Encoder(data.decode("utf-8"), u.bos, u.eos, u.append_eos, u.dtype, u.chunk_chars)
        _encoders.clear()
        _encoders[key] = (encoder, encoder.load())
    return _encoders[key]


def shard_load_encoder(u: EncodeUnit) -> None:
    """Load the encoder of u's settings into this process (a pool worker, before its units)."""
    _encoder_for(u)


def shard_encode_unit(u: EncodeUnit) -> dict:
    """Encode the unit's rows of its part into its folder of .units/; returns its marker (part,
    rows, documents, tokens per split, UTF-8 bytes). Removes what an earlier attempt left there
    first and writes the marker last, so a marker always vouches for complete files."""
    started = time.time()
    fsio.rm(u.folder, recursive=True)
    if u.threads:
        # N processes x `threads` threads should not oversubscribe the cores. tiktoken reads it
        # on every call; rayon once, when tokenizers first builds its thread pool in a process,
        # so in the driver that pool keeps this size after the stage: only HF batch encodes use
        # it, and a `codex data` command ends with its stage
        os.environ["RAYON_NUM_THREADS"] = str(u.threads)
    encoder, tok = _encoder_for(u)
    counts = fsio.with_retries(lambda: _encode_to_files(u, encoder, tok), u.folder)
    marker = {
        "part": fsio.basename(u.path),
        "rows": [u.start, u.stop],
        "fingerprint": u.fingerprint,
        # who ran it and when: for the log and the curious, never part of the output
        "worker": worker_id(),
        "started": started,
        "finished": time.time(),
        **counts,
    }
    path = u.file(UNIT_DONE)
    fsio.with_retries(lambda: fsio.write_json(path, marker), path)
    return marker


def _encode_to_files(u: EncodeUnit, encoder: Encoder, tok: EncodeWith) -> dict:
    """Stream the unit's documents through the encoder into SPLIT.tokens (ids, in order) and
    SPLIT.lens (tokens per document, int64)."""
    documents = dict.fromkeys(SPLITS, 0)
    tokens = dict.fromkeys(SPLITS, 0)
    lens: dict[str, list[np.ndarray]] = {sp: [] for sp in SPLITS}
    n_bytes = 0
    with contextlib.ExitStack() as stack:
        files = {sp: stack.enter_context(fsio.atomic_open(u.file(f"{sp}.tokens"))) for sp in SPLITS}

        def encode(texts: list[str], is_val: list[bool]) -> None:
            flat, per_doc = encoder.encode(tok, texts)
            val = np.array(is_val, bool)
            for sp, sel in (("train", ~val), ("val", val)):
                if sel.all():
                    ids, n = flat, per_doc
                elif sel.any():
                    ids, n = flat[np.repeat(sel, per_doc)], per_doc[sel]
                else:
                    continue
                files[sp].write(ids.tobytes())
                lens[sp].append(n)
                tokens[sp] += len(ids)
                documents[sp] += len(n)

        batch: list[str] = []
        is_val: list[bool] = []
        chars = 0
        for texts in read_text_rows(u.path, u.start, u.stop):
            for text in texts:
                data = text.encode("utf-8")
                n_bytes += len(data)
                batch.append(text)
                is_val.append(split_value_bytes(data) < u.val_fraction)
                chars += len(text)
                if chars >= BATCH_CHARS:
                    encode(batch, is_val)
                    batch, is_val, chars = [], [], 0
        if batch:
            encode(batch, is_val)
    for sp in SPLITS:
        per_doc = np.concatenate(lens[sp]) if lens[sp] else np.zeros(0, np.int64)
        fsio.write_bytes(u.file(f"{sp}.lens"), per_doc.astype("<i8").tobytes())
    return {"documents": documents, "tokens": tokens, "bytes": n_bytes}


# --- the phase ------------------------------------------------------------------------------------


def _encoder_threads(where: Where, n_units: int) -> int:
    """Encoder threads per process for n_units encode units; 0 leaves them alone. In this process
    (run_units runs one unit, or workers=1, here) tokenizers uses every core; Ray's runtime sets 1
    thread a task; N local processes share the cores."""
    if where.executor != "local" or where.workers == 1 or n_units <= 1:
        return 0
    return max(1, cores() // min(where.workers, n_units))


def _listing(folder: str) -> dict[str, int]:
    """Size of every file under `folder` by its path relative to it ({} when there is none): one
    listing, not a request a file."""
    fs, p = fsio.filesystem(folder)
    fs.invalidate_cache()
    if not fs.exists(p):
        return {}
    root = p.rstrip("/") + "/"
    return {
        name[len(root) :]: int(info.get("size") or 0)
        for name, info in fs.find(p, detail=True).items()
        if name.startswith(root)
    }


def _encoded(units: list[EncodeUnit], itemsize: int) -> dict[str, dict]:
    """{unit folder: marker} of the units an earlier run encoded with these settings (same part,
    same rows), whose files are all there (sizes as the marker says) and whose document counts
    match the scan."""
    if not units:
        return {}
    sizes = _listing(units[0].units_dir)

    def rel(u: EncodeUnit, name: str) -> str:
        return f"{fsio.basename(u.folder)}/{name}"

    found = [u for u in units if rel(u, UNIT_DONE) in sizes]
    done = {}
    for u, m in zip(found, read_markers([u.file(UNIT_DONE) for u in found]), strict=True):
        if (
            m is None
            or m.get("fingerprint") != u.fingerprint
            or m.get("part") != fsio.basename(u.path)
            or m.get("rows") != [u.start, u.stop]
            or m.get("documents") != u.documents
        ):
            continue
        if all(
            sizes.get(rel(u, f"{sp}.tokens")) == m["tokens"][sp] * itemsize
            and sizes.get(rel(u, f"{sp}.lens")) == m["documents"][sp] * 8
            for sp in SPLITS
        ):
            done[u.folder] = m
    return done


def encode_phase(units: list[EncodeUnit], where: Where) -> list[dict]:
    """Every unit's marker, in corpus order; encodes the units that have none."""
    itemsize = np.dtype(units[0].dtype).itemsize
    markers = _encoded(units, itemsize)
    todo = [u for u in units if u.folder not in markers]
    threads = _encoder_threads(where, len(todo))
    for u in todo:
        u.threads = threads
    total = sum(sum(u.documents.values()) for u in todo)
    with Progress("shard", total=total, unit="docs", enabled=bool(todo)) as prog:
        for u, m in run_units(shard_encode_unit, todo, where):
            if m["documents"] != u.documents:
                raise RuntimeError(
                    f"shard: {u.path} changed while it was read (rows [{u.start}, {u.stop}) held "
                    f"{u.documents} documents, then {m['documents']})"
                )
            markers[u.folder] = m
            prog.update(
                sum(m["documents"].values()), tokens=sum(m["tokens"].values()), bytes=m["bytes"]
            )
    parts = len({u.index for u in units})
    log.info(
        "shard: encoded %d of %d units of %d parts (%d done by an earlier run)",
        len(todo),
        len(units),
        parts,
        len(units) - len(todo),
    )
    return [markers[u.folder] for u in units]
