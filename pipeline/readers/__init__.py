"""The one place codex opens input documents: streaming readers for every data stage.

    read_records(piece, clean_cfg, report)  clean, eval --data: records, bad input counted per file
    iter_text_batches(path)                 tokenize, shard: lists of texts; bad input raises
    parquet_text_rows(path, start, stop)    shard's units: the texts of a row range

record.py (InputFile, Piece, Record, FileReport), text.py, jsonl.py and parquet.py (one format
each). docs/stages.md (how clean reads its inputs) has the details. Which files to read is
pipeline/inputs.py's business. Imports codex/ only; no stage.
"""

from __future__ import annotations

from collections.abc import Iterator

from codex.core import fsio
from codex.pipeline.readers.jsonl import jsonl_texts, read_jsonl
from codex.pipeline.readers.parquet import (
    forget_row_group,
    parquet_row_groups,
    parquet_text_rows,
    parquet_texts,
    read_parquet,
    read_part,
)
from codex.pipeline.readers.record import (
    JSONL_SUFFIXES,
    READ_BATCH_ROWS,
    BadInputFile,
    FileReport,
    InputFile,
    Piece,
    Record,
    splittable,
)
from codex.pipeline.readers.text import read_text, split_regex

# what the stages import: the entries below and these
__all__ = [
    "JSONL_SUFFIXES",
    "BadInputFile",
    "FileReport",
    "InputFile",
    "Piece",
    "Record",
    "forget_row_group",
    "iter_text_batches",
    "parquet_row_groups",
    "parquet_text_rows",
    "read_part",
    "read_records",
    "splittable",
    "split_regex",
]


def read_records(piece: Piece | InputFile, cfg, report: FileReport) -> Iterator[Record]:
    """Yield the records of one input file or piece of it (cfg: CleanConfig). Raises BadInputFile
    / OSError."""
    if isinstance(piece, InputFile):
        piece = Piece(piece)
    f = piece.file
    if f.not_read:  # a link (pipeline/inputs.py): never an empty document
        if f.unreadable and not cfg.skip_unreadable_links:
            report.unreadable_link = True
            raise BadInputFile(f"{f.path}: {f.not_read}")
        report.skipped_link = f.not_read
        return
    if f.size == 0 and f.kind != "parquet":
        report.empty = True
        if f.kind == "text" and not f.delimiter(cfg):
            yield Record(f.path, "", 0)  # an empty document: the length filter drops it, counted
        return
    if f.kind == "text":
        yield from read_text(piece, cfg, report)
    elif f.kind == "jsonl":
        yield from read_jsonl(piece, cfg, report)
    else:
        yield from read_parquet(piece, cfg, report)


def iter_text_batches(
    path: str,
    text_field: str = "text",
    text_column: str = "text",
    batch_rows: int = READ_BATCH_ROWS,
) -> Iterator[list]:
    """Lists of document texts (None for a null row or value) in file order: .parquet (column
    `text_column`), .jsonl[.gz|.zst] (field `text_field`), anything else = one UTF-8 document.
    Unlike read_records, bad input stops here: these stages must not train on part of a file."""
    if path.lower().endswith(".parquet"):
        yield from parquet_texts(path, text_column, batch_rows)
    elif path.lower().endswith(JSONL_SUFFIXES):
        yield from jsonl_texts(path, text_field, batch_rows)
    else:
        try:
            yield [fsio.read_bytes(path).decode("utf-8")]
        except UnicodeDecodeError as e:
            raise BadInputFile(f"{path}: not UTF-8 text (byte {e.start})") from None
