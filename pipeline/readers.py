"""The one place codex opens input documents: streaming readers for every data stage.

    read_records(piece, clean_cfg, report) `codex data clean`, `codex eval --data`: records with
                                           bad input counted per file, never fatal
    piece_starts / splittable              where a file may be cut into pieces that separate
                                           workers read
    read_part(path)                        a cleaned part as a table (clean's final dedup pass)
    iter_text_batches(path)                `codex data tokenize`, `codex data shard`: lists of
                                           texts; bad input raises BadInputFile naming the file
    parquet_text_rows(path, start, stop)   `codex data shard`'s units: the texts of a row range,
                                           its process's last row group kept for the next range
Which files to read is pipeline/inputs.py's business.

Formats (by file name):
  text  (.txt and `data.clean.text_extensions`, e.g. .py): one document per file, or split on
        `data.clean.txt_delimiter`
  .jsonl / .jsonl.gz / .jsonl.zst: one JSON object a line, text in `data.clean.text_field`
  .parquet: text in `data.clean.text_column`

Metadata: a .jsonl record's other fields / a .parquet row's other columns named by
`data.clean.metadata` (and the URL field when `data.clean.near_dedup` compares URLs) come with it
as strings (`Record.meta`; non-string values as JSON); text files have none.

Pieces: a big file is read by several workers, each taking the records that START inside its
byte range [start, end) (.jsonl lines, delimited text) or its row groups (.parquet); a record that
crosses `end` is finished by the piece it started in, so every record is read exactly once and the
records do not depend on where the cuts are. A piece that starts mid-file finds its first record
by the same leftmost, non-overlapping delimiter matching a reader from the file's start does
(`_first_record_start`). Compressed .jsonl.gz/.zst and undelimited text are one piece. Record
ids name the byte offset (`path@123`) or row (`path#7`) where the record starts: a worker that
starts mid-file cannot know line numbers.

Memory stays bounded: files are read in blocks / lines / row batches, and a record bigger than
`max_record_bytes` on disk (e.g. a 200 MB line) is skipped without being held, and yielded as
`Record(text=None)` so the stage counts it as dropped ("length:too_long").

Bad input never stops the run; it is counted in the file's `FileReport`: invalid UTF-8 (replaced
with U+FFFD and counted), malformed JSONL lines (skipped; count + first line numbers), null
parquet cells. Errors that make a whole file unusable (unreadable, parquet without the text
column) raise `BadInputFile`; the stage records it and carries on with the other files.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from codex.core import fsio

log = logging.getLogger("codex.clean")

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
FIRST_N = 5  # how many malformed line numbers a report keeps
READ_BATCH_ROWS = 1024  # parquet rows / jsonl lines per batch of iter_text_batches


class BadInputFile(ValueError):
    """A whole input file cannot be used; the message names the file and why."""


@dataclass
class InputFile:
    path: str
    size: int
    kind: str  # "text", "jsonl" or "parquet"
    # a source's own settings (data.clean.sources); "" / None: data.clean.preset / txt_delimiter
    preset: str = ""
    txt_delimiter: str | None = None

    def delimiter(self, cfg) -> str:
        """The text delimiter this file is read with (its source's, else data.clean's)."""
        return cfg.txt_delimiter if self.txt_delimiter is None else self.txt_delimiter


@dataclass
class Piece:
    """The records of `file` that start in [start, end): bytes of .jsonl / delimited text, row
    groups of .parquet. end=-1 is the end of the file."""

    file: InputFile
    start: int = 0
    end: int = -1

    @property
    def path(self) -> str:
        return self.file.path


def splittable(f: InputFile, txt_delimiter: str) -> bool:
    """Whether pieces of `f` can be read independently (compressed streams cannot);
    txt_delimiter is the one it is read with (InputFile.delimiter)."""
    name = f.path.lower()
    if f.kind == "jsonl":
        return not name.endswith((".gz", ".zst"))
    return f.kind == "parquet" or (f.kind == "text" and bool(txt_delimiter))


@dataclass
class Record:
    id: str
    text: str | None  # None: over max_record_bytes, skipped unread
    nbytes: int  # bytes on disk (UTF-8 bytes for parquet)
    # the fields of meta_fields(cfg) that the record has, as strings (.jsonl, .parquet)
    meta: dict[str, str | None] | None = None


def meta_fields(cfg) -> list[str]:
    """The JSONL fields / parquet columns a record carries besides its text (cfg: CleanConfig):
    data.clean.metadata, and the URL when the near-dedup compares URLs."""
    fields = list(cfg.metadata)
    nd = cfg.near_dedup
    if nd.enabled and nd.url and nd.url_field not in fields:
        fields.append(nd.url_field)
    return fields


def _meta_value(v) -> str | None:
    """A metadata value as a part's string column holds it: strings as they are, other values as
    JSON (a number, a list), null as null."""
    if v is None or isinstance(v, str):
        return v
    try:
        return json.dumps(v, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return str(v)


@dataclass
class FileReport:
    """What went wrong in one file (all zeros for a clean file)."""

    path: str
    records: int = 0
    invalid_utf8_records: int = 0
    replaced_bytes: int = 0  # U+FFFD introduced by decoding
    nul_chars: int = 0  # NUL characters removed by normalisation (set by the stage)
    oversized_records: int = 0
    malformed_lines: int = 0
    malformed_first: list[str] = field(default_factory=list)  # "line 7: <why>"
    null_values: int = 0
    empty: bool = False
    dropped_whole: str = ""  # the file was one document, dropped by this rule (set by the stage)
    error: str = ""

    def bad(self) -> bool:
        return bool(
            self.invalid_utf8_records
            or self.nul_chars
            or self.oversized_records
            or self.malformed_lines
            or self.null_values
            or self.empty
            or self.dropped_whole
            or self.error
        )

    def describe(self) -> str:
        """What went wrong, in words (for the log)."""
        parts = []
        if self.empty:
            parts.append("empty file")
        if self.invalid_utf8_records:
            parts.append(
                f"invalid UTF-8 in {self.invalid_utf8_records} records "
                f"({self.replaced_bytes} replaced)"
            )
        if self.nul_chars:
            parts.append(f"{self.nul_chars} NUL characters removed")
        if self.oversized_records:
            parts.append(f"{self.oversized_records} records over max_record_bytes skipped")
        if self.malformed_lines:
            parts.append(
                f"{self.malformed_lines} malformed lines skipped "
                f"(first: {'; '.join(self.malformed_first)})"
            )
        if self.null_values:
            parts.append(f"{self.null_values} null values skipped")
        return ", ".join(parts)


def _decode(raw: bytes, report: FileReport) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "replace")
        report.invalid_utf8_records += 1
        report.replaced_bytes += text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")
    return text[1:] if text.startswith("\ufeff") else text  # a UTF-8 byte-order mark is not text


def read_records(piece: Piece | InputFile, cfg, report: FileReport) -> Iterator[Record]:
    """Yield the records of one input file or piece of it (cfg: CleanConfig). Raises BadInputFile
    / OSError."""
    if isinstance(piece, InputFile):
        piece = Piece(piece)
    f = piece.file
    if f.size == 0 and f.kind != "parquet":
        report.empty = True
        if f.kind == "text" and not f.delimiter(cfg):
            yield Record(f.path, "", 0)  # an empty document: the length filter drops it, counted
        return
    if f.kind == "text":
        yield from _read_text(piece, cfg, report)
    elif f.kind == "jsonl":
        yield from _read_jsonl(piece, cfg, report)
    else:
        yield from _read_parquet(piece, cfg, report)


BLANK_LINES = "blank-lines"  # --txt-delimiter blank-lines: lines holding only white space


def text_delimiter(delim: str) -> bytes:
    """data.clean.txt_delimiter as bytes; escapes typed on the command line (--txt-delimiter
    '\\n\\n') are understood."""
    if "\\" in delim:
        delim = delim.encode("ascii", "backslashreplace").decode("unicode_escape")
    return delim.encode("utf-8")


def _read_text(piece: Piece, cfg, report: FileReport) -> Iterator[Record]:
    f = piece.file
    limit = cfg.max_record_bytes
    setting = f.delimiter(cfg)
    if not setting:
        if limit and f.size > limit:
            report.oversized_records += 1
            yield Record(f.path, None, f.size)
            return
        with fsio.open(f.path, "rb") as fh:
            raw = fh.read()
        yield Record(f.path, _decode(raw, report), len(raw))
        return
    if setting == BLANK_LINES:
        with fsio.open(f.path, "rb") as fh:
            for at, raw, n in _blank_line_records(fh, piece, limit):
                if raw is None:
                    report.oversized_records += 1
                    yield Record(f"{f.path}@{at}", None, n)
                else:
                    yield Record(f"{f.path}@{at}", _decode(raw, report), n)
        return
    delim = text_delimiter(setting)
    with fsio.open(f.path, "rb") as fh:
        first = _first_record_start(fh, piece.start, delim)
        if first is None:
            return
        end = piece.end if piece.end >= 0 else f.size
        pos = first
        for raw, n in _split_stream(fh, first, delim, limit):
            if pos >= end:
                break
            if raw is None:
                report.oversized_records += 1
                yield Record(f"{f.path}@{pos}", None, n)
            elif raw.strip():
                yield Record(f"{f.path}@{pos}", _decode(raw, report), n)
            pos += n


def _lines(fh, start: int) -> Iterator[tuple[int, list[bytes], bool]]:
    """(bytes, the line in blocks, whether it is blank: only spaces, tabs, CR) for each line from
    byte `start` (a line start); a huge line comes in 1 MB blocks, never whole."""
    fh.seek(start)
    while True:
        blocks, n, blank = [], 0, True
        while True:
            block = fh.readline(1 << 20)
            if not block:
                break
            blocks.append(block)
            n += len(block)
            blank = blank and not block.strip()
            if block.endswith(b"\n"):
                break
        if not n:
            return
        yield n, blocks, blank


def _line_before_is_blank(fh, pos: int) -> bool:
    """Whether the line that ends just before byte `pos` (a line start > 0) is blank: read back to
    its start, stopping at the first byte that is not white space."""
    at = pos - 1  # its newline
    while at > 0:
        lo = max(0, at - (1 << 16))
        fh.seek(lo)
        block = fh.read(at - lo)
        cut = block.rfind(b"\n")
        if block[cut + 1 :].strip():
            return False
        if cut >= 0:
            return True
        at = lo
    return True


def _blank_line_records(fh, piece: Piece, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """--txt-delimiter blank-lines: a document is a run of non-blank lines, and any number of
    lines holding only white space separate documents. Yields (start byte, text or None when over
    `limit`, bytes) for the documents that start in the piece: a document starts at a non-blank
    line whose previous line is blank (or at the file's start), which a reader decides from that
    one line back, wherever it starts."""
    start, end = piece.start, piece.end if piece.end >= 0 else 1 << 62
    if start:
        first = next(_occurrences(fh, start - 1, b"\n"), None)
        if first is None:
            return
        pos, prev_blank = first + 1, _line_before_is_blank(fh, first + 1)
    else:
        pos, prev_blank = 0, True
    at, size = -1, 0  # the open document: its start (-1: none), bytes
    parts: list[bytes] | None = []  # its text; None once it is over `limit`
    for n, blocks, blank in _lines(fh, pos):
        if blank or (at < 0 and not prev_blank):  # a separator, or the rest of an earlier piece's
            if at >= 0:
                yield at, (b"".join(parts).removesuffix(b"\n") if parts is not None else None), size
                at = -1
        else:
            if at < 0:
                if pos >= end:
                    return
                at, parts, size = pos, [], 0
            size += n
            if parts is not None:
                parts += blocks
                if limit and size > limit:
                    parts = None  # over max_record_bytes: count it, keep none of it
        prev_blank = blank
        pos += n
    if at >= 0:
        yield at, (b"".join(parts).removesuffix(b"\n") if parts is not None else None), size


def _occurrences(fh, start: int, delim: bytes) -> Iterator[int]:
    """Positions of `delim` from byte `start` on, matched as a reader from `start` does: leftmost
    first, never overlapping the previous match."""
    fh.seek(start)
    buf, base = b"", start  # buf holds the file from byte `base`
    at = 0
    while True:
        block = fh.read(1 << 20)
        buf = buf[at:] + block
        base += at
        at = 0
        while (j := buf.find(delim, at)) >= 0:
            yield base + j
            at = j + len(delim)
        if not block:
            return
        at = max(at, len(buf) - len(delim) + 1)  # a match may straddle two blocks


def _first_record_start(fh, start: int, delim: bytes) -> int | None:
    """The first record start at or after byte `start` (None: no record starts there).

    Records start at 0 and right after each match of a reader from byte 0. Without reading from
    0: take the first occurrence that could end at or after `start`, walk back over occurrences
    overlapping it (only a self-overlapping delimiter such as '\\n\\n' has any) to the first
    one no earlier occurrence overlaps, which a reader from 0 must match too, and match forward
    from there."""
    if start == 0:
        return 0
    n = len(delim)
    first = next(_occurrences(fh, max(0, start - n), delim), None)
    if first is None:
        return None
    cluster, back = first, 1 << 16
    while True:  # walk back inside a window; widen it for a long run such as many newlines
        lo = max(0, cluster - back)
        fh.seek(lo)
        window = fh.read(cluster + n - lo)
        c = cluster
        while True:
            earlier = [i for i in range(max(lo, c - n + 1), c) if window.startswith(delim, i - lo)]
            if not earlier:
                break
            c = earlier[0]
        if c - lo >= n or lo == 0:
            cluster = c
            break
        cluster, back = c, back * 4
    for m in _occurrences(fh, cluster, delim):
        if m + n >= start:
            return m + n
    return None


def _split_stream(fh, start: int, delim: bytes, limit: int) -> Iterator[tuple[bytes | None, int]]:
    """(record, bytes) for each delimiter-separated record from byte `start` (a record start),
    streaming; (None, bytes) when over limit. bytes counts the record and its delimiter."""
    buf = bytearray()
    skipping = 0  # > 0 while inside an oversized piece: bytes of it seen so far
    fh.seek(start)
    while True:
        block = fh.read(1 << 20)
        if block:
            buf += block
        start = 0
        while (j := buf.find(delim, start)) >= 0:
            if skipping:
                yield None, skipping + j - start + len(delim)
                skipping = 0
            else:
                yield bytes(buf[start:j]), j - start + len(delim)
            start = j + len(delim)
        del buf[:start]
        if not block:
            break
        if limit and (skipping or len(buf) > limit):
            keep = len(delim) - 1  # a delimiter may straddle two blocks
            skipping += len(buf) - keep
            del buf[: len(buf) - keep]
    if skipping:
        yield None, skipping + len(buf)
    elif buf:
        yield bytes(buf), len(buf)


def _open_decompressed(path: str, fh):
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=fh)
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(path, fh), 1 << 20)
    # fsspec's remote files have no readline(size), which bounds a huge line
    if fsio.is_remote(path):
        return io.BufferedReader(fh, 1 << 20)
    return fh


class _ZstdReader(io.RawIOBase):
    """Streaming zstd decompression (frames back to back) that reports damage as errors the stage
    records per file: random bytes raise BadInputFile, a stream that ends inside a frame (a
    truncated download) raises EOFError, like gzip does. zstandard's stream_reader returns a silent
    EOF for a truncated frame and raises its own ZstdError for garbage."""

    def __init__(self, path: str, fh):
        import zstandard  # only when a .zst input is read: other inputs run without it

        self.path, self.fh, self._zstd = path, fh, zstandard
        self.dobj = zstandard.ZstdDecompressor().decompressobj()
        self.pending = b""
        self.in_frame = False  # fed bytes of a frame that has not ended yet

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self.pending:
            block = self.fh.read(1 << 20)
            if not block:
                if self.in_frame:
                    raise EOFError(
                        f"{self.path}: compressed file ended before the end of its zstd frame "
                        "(truncated)"
                    )
                return 0
            self._feed(block)
        n = min(len(buf), len(self.pending))
        buf[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n

    def _feed(self, block: bytes) -> None:
        while block:
            try:
                self.pending += self.dobj.decompress(block)
            except self._zstd.ZstdError as e:
                raise BadInputFile(f"{self.path}: not a valid zstd stream ({e})") from None
            self.in_frame = not self.dobj.eof
            block = self.dobj.unused_data if self.dobj.eof else b""
            if self.dobj.eof:  # the next frame starts in the leftover bytes
                self.dobj = self._zstd.ZstdDecompressor().decompressobj()


def _read_jsonl(piece: Piece, cfg, report: FileReport) -> Iterator[Record]:
    f = piece.file
    limit = cfg.max_record_bytes or (1 << 62)
    key = cfg.text_field
    fields = meta_fields(cfg)

    def malformed(lineno: int, offset: int, why: str) -> None:
        report.malformed_lines += 1
        if len(report.malformed_first) < FIRST_N:
            # a piece from the file's start counts lines; one from mid-file cannot
            where = f"line {lineno}" if piece.start == 0 else f"byte {offset}"
            report.malformed_first.append(f"{where}: {why}")

    with fsio.open(f.path, "rb") as raw_fh:
        fh = _open_decompressed(f.path, raw_fh)
        pos = _first_record_start(fh, piece.start, b"\n") if piece.start else 0
        if pos is None:
            return
        if pos:
            fh.seek(pos)
        end = piece.end if piece.end >= 0 else 1 << 62
        lineno = 0
        while pos < end:
            line = fh.readline(limit + 1)
            if not line:
                break
            lineno += 1
            at, pos = pos, pos + len(line)
            if len(line) > limit and not line.endswith(b"\n"):  # a huge line: skip the rest unread
                n = len(line)
                while rest := fh.readline(1 << 20):
                    n += len(rest)
                    if rest.endswith(b"\n"):
                        break
                pos = at + n
                report.oversized_records += 1
                yield Record(f"{f.path}@{at}", None, n)
                continue
            if not line.strip():
                continue
            text = _decode(line, report)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                malformed(lineno, at, f"invalid JSON ({e.msg}, column {e.colno})")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
                got = (
                    "not an object"
                    if not isinstance(obj, dict)
                    else (
                        f"no field '{key}' (fields: {', '.join(list(obj)[:10])})"
                        if key not in obj
                        else f"field '{key}' is {type(obj[key]).__name__}, not a string"
                    )
                )
                malformed(lineno, at, got)
                continue
            meta = {k: _meta_value(obj.get(k)) for k in fields} if fields else None
            yield Record(f"{f.path}@{at}", obj[key], len(line), meta)


def parquet_row_groups(path: str) -> list[tuple[int, int]]:
    """(rows, compressed bytes) of each row group of a parquet file (its footer only)."""
    with fsio.open(path, "rb") as fh:
        md = pq.ParquetFile(fh).metadata
        return [
            (md.row_group(i).num_rows, md.row_group(i).total_byte_size)
            for i in range(md.num_row_groups)
        ]


def _read_parquet(piece: Piece, cfg, report: FileReport) -> Iterator[Record]:
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
                        {k: _meta_value(v[i]) for k, v in extra.items()} if fields else None,
                    )
                row += 1


def read_part(path: str) -> pa.Table:
    """A whole cleaned parquet part, every column (clean's cross-chunk dedup rewrites it).
    ParquetFile, not pq.read_table: that one builds a dataset, whose module imports pandas
    where it is installed (about 0.25 s of CPU a process)."""
    with fsio.open(path, "rb") as fh:
        return pq.ParquetFile(fh).read()


# --- plain text batches (tokenize, shard) ---------------------------------------------------------


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
        yield from _parquet_texts(path, text_column, batch_rows)
    elif path.lower().endswith(JSONL_SUFFIXES):
        yield from _jsonl_texts(path, text_field, batch_rows)
    else:
        try:
            yield [fsio.read_bytes(path).decode("utf-8")]
        except UnicodeDecodeError as e:
            raise BadInputFile(f"{path}: not UTF-8 text (byte {e.start})") from None


def _parquet_texts(path: str, column: str, batch_rows: int) -> Iterator[list]:
    with fsio.open(path, "rb") as fh:
        try:
            pf = pq.ParquetFile(fh)
        except Exception as e:
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


def _jsonl_texts(path: str, key: str, batch_rows: int) -> Iterator[list]:
    batch: list = []
    with fsio.open(path, "rb", compression="infer") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[key]
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadInputFile(f"{path}:{lineno}: not valid JSON ({e})") from None
            except (KeyError, TypeError):
                raise BadInputFile(f"{path}:{lineno}: no '{key}' field") from None
            if text is not None and not isinstance(text, str):
                raise BadInputFile(
                    f"{path}:{lineno}: '{key}' is {type(text).__name__}, not a string"
                )
            batch.append(text)
            if len(batch) >= batch_rows:
                yield batch
                batch = []
    if batch:
        yield batch
