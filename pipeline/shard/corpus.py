"""The shard stage's input: the cleaned parts' documents in corpus order (read_text_batches; one
part's row range: read_text_rows, reading only the row groups that hold it), and the train/val split
each document falls in (split_value: a function of its text alone).

Read by the scan (scan.py) and by each encode unit (encode.py); bad input is a ShardDataError that
names the file (and the row).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from codex.pipeline.readers import BadInputFile, iter_text_batches, parquet_text_rows
from codex.pipeline.shard.errors import ShardDataError

READ_ROWS = 2048  # parquet rows decoded at a time


# --- the train/val split --------------------------------------------------------------------------


def split_value(text: str) -> float:
    """Where a document falls in [0, 1): the first 8 bytes of its BLAKE2b hash. val if
    < val_fraction.

    A function of the text alone, so the split is the same on every rerun and machine, and exact
    duplicates always land in the same split (no train/val leak through copies).
    """
    return split_value_bytes(text.encode("utf-8"))


def split_value_bytes(data: bytes) -> float:
    """split_value of a text's UTF-8 bytes (the scan and the encode units have them already)."""
    h = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


# --- reading the cleaned parts --------------------------------------------------------------------


def read_text_batches(files: list[str]):
    """Yield lists of document texts in corpus order (files sorted, rows in order); a null text or
    an unreadable file is a ShardDataError naming it."""
    for path in files:
        yield from _checked(path, iter_text_batches(path, batch_rows=READ_ROWS), 0)


def read_text_rows(path: str, start: int, stop: int) -> Iterator[list[str]]:
    """Lists of the texts of rows [start, stop) of one cleaned part, in order (readers/parquet.py:
    parquet_text_rows reads only the row groups that hold them). A null text or an unreadable
    file is a ShardDataError naming it (and the row)."""
    yield from _checked(path, parquet_text_rows(path, start, stop, batch_rows=READ_ROWS), start)


def _checked(path: str, batches: Iterator[list], row: int) -> Iterator[list[str]]:
    """`batches` of `path` from row `row` on, bad input as a ShardDataError naming the file."""
    try:
        for texts in batches:
            if None in texts:
                raise ShardDataError(f"{path}: row {row + texts.index(None)}: text is null")
            yield texts
            row += len(texts)
    except BadInputFile as e:
        raise ShardDataError(str(e)) from None
