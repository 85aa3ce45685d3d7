"""Cleaned documents -> parquet parts (text, id, source [, metadata columns] [, score columns]
[, reason]), each part written atomically."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from codex.core import fsio

_MAX_ROW_GROUP_BYTES = 256 << 20  # a row group is cut early only if its text would exceed this


def part_prefix(out: str, unit: str) -> str:
    """The name a unit's parts start with (PREFIX-000.parquet, ...), in out/ and out/rejected/:
    part-UNIT, on an object store with a hash of the unit first (fsio.spread)."""
    return f"part-{fsio.spread(out, unit)}"


def marker_path(out: str, unit: str) -> str:
    """A unit's marker: out/markers/UNIT.json (fsio.spread on an object store)."""
    return fsio.join(out, "markers", f"{fsio.spread(out, unit)}.json")


def hash_path(out: str, unit: str) -> str:
    """A unit's hash file: out/hashes/UNIT.npy (fsio.spread on an object store)."""
    return fsio.join(out, "hashes", f"{fsio.spread(out, unit)}.npy")


def string_array(values: list[str]) -> pa.Array:
    """pa.array(values, pa.string()), put together from its buffers: pyarrow's constructors
    (pa.array, pa.table) import pandas on their first call where it is installed, about 0.3 s of
    CPU in every process that writes parts (each worker), for nothing here."""
    data = list(map(str.encode, values))
    offsets = np.zeros(len(data) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, data), dtype=np.int64, count=len(data)), out=offsets[1:])
    if offsets[-1] >= 1 << 31:  # over string's 32-bit offsets: let pyarrow cut it in chunks
        return pa.array(values, pa.string())
    buffers = [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(data))]
    return pa.Array.from_buffers(pa.string(), len(values), buffers)


def float_array(values: list) -> pa.Array:
    """pa.array(values, pa.float64()) with None as null, from its buffers (string_array)."""
    valid = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    data = np.array([0.0 if v is None else v for v in values], dtype=np.float64)
    bits = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(pa.float64(), len(values), [bits, pa.py_buffer(data)])


def bool_array(values: list[bool]) -> pa.Array:
    """pa.array(values, pa.bool_()) from its bits (no pandas import: string_array)."""
    bits = np.packbits(np.asarray(values, dtype=bool), bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits)])


class PartWriter:
    """Streams rows into prefix-000.parquet, prefix-001.parquet, ... (docs_per_shard rows each,
    zstd, row groups of row_group_size rows), each file written atomically. These are the cleaned
    corpus's parquet parts; "shard" in codex means a token shard (pipeline/shard/shard.py)."""

    def __init__(
        self,
        out_dir: str,
        prefix: str,
        docs_per_shard: int,
        row_group_size: int,
        with_reason: bool = False,
        meta_columns: tuple[str, ...] = (),
        score_columns: tuple[tuple[str, str], ...] = (),
    ):
        """7 parameters: where, the part size, and the columns (fasttext_filters.py:
        score_columns gives the last: (name, "string" | "float"), nullable)."""
        self.out_dir, self.prefix = out_dir, prefix
        self.docs_per_shard, self.row_group_size = docs_per_shard, row_group_size
        cols = [("text", pa.string()), ("id", pa.string()), ("source", pa.string())]
        # data.clean.metadata: nullable, so built by pa.array (string_array takes no nulls)
        self.nullable = set(range(3, 3 + len(meta_columns)))
        cols += [(name, pa.string()) for name in meta_columns]
        self.floats = {
            len(cols) + i for i, (_, kind) in enumerate(score_columns) if kind == "float"
        }
        self.nullable |= set(range(len(cols), len(cols) + len(score_columns)))
        cols += [(n, pa.float64() if k == "float" else pa.string()) for n, k in score_columns]
        self.schema = pa.schema(cols + ([("reason", pa.string())] if with_reason else []))
        self.rows: list[list] = [[] for _ in self.schema.names]
        self.row_bytes = 0
        self.shards: list[str] = []
        self._ctx: AbstractContextManager[IO[Any]] | None = None
        self._writer: pq.ParquetWriter | None = None
        self._fh: IO[Any] | None = None
        self._in_shard = 0
        self.bytes = 0  # of the parts closed so far, on disk

    def add(self, *values: str | float | None) -> None:
        for col, v in zip(self.rows, values, strict=False):
            col.append(v)
        self.row_bytes += len(values[0] or "")  # type: ignore[arg-type]
        if len(self.rows[0]) >= self.row_group_size or self.row_bytes > _MAX_ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        while self.rows[0]:
            if self._writer is None:
                name = f"{self.prefix}-{len(self.shards):03d}.parquet"
                self.shards.append(name)
                self._ctx = fsio.atomic_open(fsio.join(self.out_dir, name), "wb")
                self._fh = self._ctx.__enter__()
                self._writer = pq.ParquetWriter(self._fh, self.schema, compression="zstd")
                self._in_shard = 0
            take = min(len(self.rows[0]), self.docs_per_shard - self._in_shard)
            columns = [
                float_array(col[:take])
                if i in self.floats
                else pa.array(col[:take], pa.string())
                if i in self.nullable
                else string_array(col[:take])
                for i, col in enumerate(self.rows)
            ]
            table = pa.Table.from_arrays(columns, schema=self.schema)
            self._writer.write_table(table, row_group_size=self.row_group_size)
            self.rows = [col[take:] for col in self.rows]
            self._in_shard += take
            if self._in_shard >= self.docs_per_shard:
                self._close_shard()
        self.row_bytes = 0

    def _close_shard(self) -> None:
        assert self._writer is not None and self._ctx is not None and self._fh is not None
        self._writer.close()
        self.bytes += self._fh.tell()  # the file's size: the writer wrote it from 0, in order
        self._ctx.__exit__(None, None, None)
        self._writer = self._ctx = self._fh = None

    def close(self) -> list[str]:
        self._flush()
        if self._writer is not None:
            self._close_shard()
        return self.shards

    def abort(self) -> None:
        if self._writer is not None:
            assert self._ctx is not None  # opened together with the writer in _flush
            try:
                self._writer.close()
            finally:
                # removes the temp file
                self._ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)


def rewrite_part(out: str, name: str, table: pa.Table, reasons: list, suffix: str, c) -> bool:
    """Rewrite part `name` (its rows in `table`, `reasons` one per row: None keeps it) without the
    rows that have a reason; with c.keep_rejected those go to rejected/NAME-SUFFIX.parquet with
    their reason. Both atomic, so a rewrite killed midway runs again to the same bytes. Returns
    whether the part changed."""
    if all(r is None for r in reasons):
        return False
    keep = [r is None for r in reasons]
    if c.keep_rejected:
        gone = table.filter(bool_array([not k for k in keep]))
        gone = gone.append_column("reason", string_array([r for r in reasons if r is not None]))
        rejected = fsio.join(out, "rejected", name.replace(".parquet", f"-{suffix}.parquet"))
        with fsio.atomic_open(rejected, "wb") as fh:
            pq.write_table(gone, fh, compression="zstd", row_group_size=c.row_group_size)
    with fsio.atomic_open(fsio.join(out, name), "wb") as fh:
        pq.write_table(
            table.filter(bool_array(keep)), fh, compression="zstd", row_group_size=c.row_group_size
        )
    return True
