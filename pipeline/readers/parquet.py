""".parquet: clean's records by row group (read_parquet), a whole cleaned part (read_part), and
the texts of tokenize and shard, whole (parquet_texts) or a row range (parquet_text_rows), which
keeps its process's last decoded row group for the next range.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from codex.core import fsio
from codex.pipeline.readers.record import (
    READ_BATCH_ROWS,
    BadInputFile,
    FileReport,
    Piece,
    Record,
    meta_fields,
    meta_value,
)


def parquet_row_groups(path: str) -> list[tuple[int, int]]:
    """(rows, compressed bytes) of each row group of a parquet file (its footer only)."""
    with fsio.open(path, "rb") as fh:
        md = pq.ParquetFile(fh).metadata
        return [
            (md.row_group(i).num_rows, md.row_group(i).total_byte_size)
            for i in range(md.num_row_groups)
        ]


def read_parquet(piece: Piece, cfg, report: FileReport) -> Iterator[Record]:
    f = piece.file
    col = cfg.text_column
    with fsio.open(f.path, "rb") as fh:
        pf = pq.ParquetFile(fh)
        names = pf.schema_arrow.names
        if col not in names:
            raise BadInputFile(
                f"{f.path}: no column '{col}' (columns: {', '.join(names)}); "
                f"choose one with --text-column / data.clean.text_column"
            )
        typ = pf.schema_arrow.field(col).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise BadInputFile(f"{f.path}: column '{col}' has type {typ}, expected a string column")
        if pf.metadata.num_rows == 0:
            report.empty = True
        groups = range(piece.start, piece.end if piece.end >= 0 else pf.metadata.num_row_groups)
        row = sum(pf.metadata.row_group(i).num_rows for i in range(piece.start))
        fields = [k for k in meta_fields(cfg) if k in names and k != col]
        for batch in pf.iter_batches(batch_size=1024, columns=[col, *fields], row_groups=groups):
            extra = {k: batch.column(1 + j).to_pylist() for j, k in enumerate(fields)}
            for i, text in enumerate(batch.column(0).to_pylist()):
                if text is None:
                    report.null_values += 1
                else:
                    yield Record(
                        f"{f.path}#{row}",
                        text,
                        len(text) if text.isascii() else len(text.encode("utf-8")),
                        {k: meta_value(v[i]) for k, v in extra.items()} if fields else None,
                    )
                row += 1


def read_part(path: str) -> pa.Table:
    """A whole cleaned parquet part, every column (clean's cross-chunk dedup rewrites it).
    ParquetFile, not pq.read_table: that one builds a dataset, whose module imports pandas
    where it is installed (about 0.25 s of CPU a process)."""
    with fsio.open(path, "rb") as fh:
        return pq.ParquetFile(fh).read()


def parquet_texts(path: str, column: str, batch_rows: int) -> Iterator[list]:
    with fsio.open(path, "rb") as fh:
        try:
            pf = pq.ParquetFile(fh)
        except Exception as e:
            if fsio.is_store_failure(e):  # the storage failed, not the file
                raise
            raise BadInputFile(f"{path}: not a readable parquet file ({e})") from None
        if column not in pf.schema_arrow.names:
            raise BadInputFile(
                f"{path}: no '{column}' column (columns: {', '.join(pf.schema_arrow.names)})"
            )
        for batch in pf.iter_batches(batch_size=batch_rows, columns=[column]):
            yield batch.column(0).to_pylist()


# The row group parquet_text_rows decoded last in this process, kept for its next call: shard cuts
# a part into row ranges and each of its processes takes them in order, so a range often starts in
# the group the process's last one ended in. A group's text costs about the same to decode for one
# row as for all of them (its pages are compressed, the dictionary is one page), so without this a
# group split into k ranges is decoded k times. Groups above ROW_GROUP_CACHE_BYTES are streamed.
ROW_GROUP_CACHE_BYTES = 64 << 20  # of the column, uncompressed
_last_group: list[tuple[str, pq.FileMetaData, int, str, pa.ChunkedArray]] = []


def _row_group_column(pf: pq.ParquetFile, path: str, i: int, column: str) -> pa.ChunkedArray:
    """Row group i's `column`, from _last_group when it holds it (the same file: its footer is
    equal, offsets and sizes of every page included)."""
    for p, meta, j, c, values in _last_group:
        if (p, j, c) == (path, i, column) and meta.equals(pf.metadata):
            return values
    values = pf.read_row_group(i, columns=[column]).column(0)
    _last_group[:] = [(path, pf.metadata, i, column, values)]
    return values


def forget_row_group() -> None:
    """Drop the row group parquet_text_rows kept (a stage done in a process that goes on: demo)."""
    _last_group.clear()


def parquet_text_rows(
    path: str, start: int, stop: int, column: str = "text", batch_rows: int = READ_BATCH_ROWS
) -> Iterator[list]:
    """Lists of the texts of rows [start, stop) of a parquet file, in order (None for a null
    value): only the row groups that hold them are read, the rows of those outside [start, stop)
    never become Python strings, and the reading stops at `stop`. A row group up to
    ROW_GROUP_CACHE_BYTES is decoded whole and kept for the next call (_last_group), a larger one
    streamed in batches. Bad input is a BadInputFile."""
    if stop <= start:
        return
    with fsio.open(path, "rb") as fh:
        try:
            pf = pq.ParquetFile(fh)
        except Exception as e:
            if fsio.is_store_failure(e):  # the storage failed, not the file
                raise
            raise BadInputFile(f"{path}: not a readable parquet file ({e})") from None
        names = pf.schema_arrow.names
        if column not in names:
            raise BadInputFile(f"{path}: no '{column}' column (columns: {', '.join(names)})")
        leaves = [pf.metadata.schema.column(j).path for j in range(pf.metadata.num_columns)]
        at = leaves.index(column) if column in leaves else -1  # -1: nested, streamed
        row = 0
        for i in range(pf.metadata.num_row_groups):
            group = pf.metadata.row_group(i)
            first, row = row, row + group.num_rows
            if row <= start or first >= stop:
                continue
            a, b = max(start, first) - first, min(stop, row) - first  # its rows to yield
            if at >= 0 and group.column(at).total_uncompressed_size <= ROW_GROUP_CACHE_BYTES:
                values = _row_group_column(pf, path, i, column)
                for k in range(a, b, batch_rows):
                    yield values.slice(k, min(batch_rows, b - k)).to_pylist()
                continue
            seen = 0
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[i], columns=[column]):
                lo, hi = max(a - seen, 0), min(b - seen, batch.num_rows)
                if hi > lo:
                    yield batch.column(0).slice(lo, hi - lo).to_pylist()
                seen += batch.num_rows
                if seen >= b:
                    break
