"""Exact dedup across the chunks of `codex data clean` (its final pass).

Each chunk wrote the 128-bit BLAKE2b hash (+ byte length) of every document it kept to
hashes/CHUNK.npy. All hashes are grouped (in hash-prefix buckets to bound memory); the first
occurrence in (task, chunk) order is kept, and parts holding later copies are rewritten without
them. Rows are matched by hash, not position, so the rewrite is idempotent.
"""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from codex import fsio
from pipeline.readers import read_part

_HASH_BUCKET_BYTES = 256 << 20  # memory for one bucket of the final dedup pass


def cross_chunk_duplicates(out: str, names: list[str], total: int) -> dict[str, dict[bytes, int]]:
    """{chunk: {hash: nbytes}} of documents whose first copy is in an earlier chunk.

    Hashes are grouped in buckets (by hash value mod B) so that one bucket of all chunks fits in
    _HASH_BUCKET_BYTES; each bucket reads every hash file once.
    """
    buckets = max(1, -(-total * 40 // _HASH_BUCKET_BYTES))
    drops: dict[str, dict[bytes, int]] = {}
    for b in range(buckets):
        parts, owners = [], []
        for i, name in enumerate(names):
            with fsio.open(fsio.join(out, "hashes", f"{name}.npy"), "rb") as fh:
                h = np.load(io.BytesIO(fh.read()))
            if buckets > 1:
                h = h[h[:, 0] % buckets == b]
            parts.append(h)
            owners.append(np.full(len(h), i, dtype=np.int64))
        if not parts:
            continue
        h = np.concatenate(parts)
        owner = np.concatenate(owners)
        order = np.lexsort((owner, h[:, 1], h[:, 0]))  # by hash, then chunk order
        hs, ow = h[order], owner[order]
        repeat = np.zeros(len(hs), dtype=bool)
        repeat[1:] = (hs[1:, 0] == hs[:-1, 0]) & (hs[1:, 1] == hs[:-1, 1])
        for row, i in zip(hs[repeat], ow[repeat], strict=True):
            drops.setdefault(names[i], {})[row[:2].tobytes()] = int(row[2])
    return drops


def rewrite_without(out: str, parts: list[str], drop: dict[bytes, int], c) -> None:
    """Rewrite the parts of one chunk without the rows whose text hash is in `drop` (idempotent)."""
    for name in parts:
        path = fsio.join(out, name)
        table = read_part(path)
        texts = table.column("text").to_pylist()
        keep = [
            hashlib.blake2b(t.encode("utf-8"), digest_size=16).digest() not in drop for t in texts
        ]
        if all(keep):
            continue
        if c.keep_rejected:
            gone = table.filter(pa.array([not k for k in keep]))
            gone = gone.append_column(
                "reason", pa.array(["dedup:duplicate"] * len(gone), pa.string())
            )
            with fsio.atomic_open(
                fsio.join(out, "rejected", name.replace(".parquet", "-dedup.parquet")), "wb"
            ) as fh:
                pq.write_table(gone, fh, compression="zstd", row_group_size=c.row_group_size)
        with fsio.atomic_open(path, "wb") as fh:
            pq.write_table(
                table.filter(pa.array(keep)),
                fh,
                compression="zstd",
                row_group_size=c.row_group_size,
            )
