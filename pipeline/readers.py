"""Streaming readers for `codex data clean`: find the input files, then yield their records.

Formats (by file name):
  text  (.txt and `data.clean.text_extensions`, e.g. .py): one document per file, or split on
        `data.clean.txt_delimiter`
  .jsonl / .jsonl.gz / .jsonl.zst: one JSON object a line, text in `data.clean.text_field`
  .parquet: text in `data.clean.text_column`

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
import os
from dataclasses import dataclass, field
from typing import Iterator

from codex import fsio

log = logging.getLogger("codex.clean")

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
FIRST_N = 5   # how many malformed line numbers a report keeps


class BadInputFile(ValueError):
    """A whole input file cannot be used; the message names the file and why."""


@dataclass
class InputFile:
    path: str
    size: int
    kind: str   # "text", "jsonl" or "parquet"


@dataclass
class Record:
    id: str
    text: str | None   # None: over max_record_bytes, skipped unread
    nbytes: int        # bytes on disk (UTF-8 bytes for parquet)


@dataclass
class FileReport:
    """What went wrong in one file (all zeros for a clean file)."""
    path: str
    records: int = 0
    invalid_utf8_records: int = 0
    replaced_bytes: int = 0           # U+FFFD introduced by decoding
    nul_chars: int = 0                # NUL characters removed by normalisation (set by the stage)
    oversized_records: int = 0
    malformed_lines: int = 0
    malformed_first: list[str] = field(default_factory=list)   # "line 7: <why>"
    null_values: int = 0
    empty: bool = False
    error: str = ""

    def bad(self) -> bool:
        return bool(self.invalid_utf8_records or self.nul_chars or self.oversized_records or self.malformed_lines
                    or self.null_values or self.empty or self.error)

    def describe(self) -> str:
        """What went wrong, in words (for the log)."""
        parts = []
        if self.empty:
            parts.append("empty file")
        if self.invalid_utf8_records:
            parts.append(f"invalid UTF-8 in {self.invalid_utf8_records} records ({self.replaced_bytes} replaced)")
        if self.nul_chars:
            parts.append(f"{self.nul_chars} NUL characters removed")
        if self.oversized_records:
            parts.append(f"{self.oversized_records} records over max_record_bytes skipped")
        if self.malformed_lines:
            parts.append(f"{self.malformed_lines} malformed lines skipped (first: {'; '.join(self.malformed_first)})")
        if self.null_values:
            parts.append(f"{self.null_values} null values skipped")
        return ", ".join(parts)


def file_kind(path: str, text_extensions: list[str]) -> str | None:
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if any(name.endswith(ext.lower()) for ext in text_extensions):
        return "text"
    return None


def list_inputs(inputs: list[str], text_extensions: list[str]) -> tuple[list[InputFile], list[str]]:
    """Expand paths, globs and directories into (files sorted by path, skipped paths).

    Inside directories and globs, files of other types are skipped (and listed). An explicitly
    named file of an unknown type or a missing path is an error; a glob that matches nothing is
    logged (the stage fails if no input file is found at all).
    """
    found: dict[str, InputFile] = {}
    skipped: list[str] = []

    def add(path: str, size: int, explicit: bool) -> None:
        kind = file_kind(path, text_extensions)
        if kind is None:
            if explicit:
                raise BadInputFile(f"{path}: unsupported file type (want .jsonl[.gz|.zst], .parquet or a text "
                                   f"extension in data.clean.text_extensions: {' '.join(text_extensions)})")
            skipped.append(path)
        else:
            found[path] = InputFile(path, size, kind)

    for spec in inputs:
        fs, p = _filesystem(spec)
        if any(c in spec for c in "*?["):
            matches = fs.glob(p, detail=True)
            if not matches:   # not an error by itself (a job may glob optional parts); no files at all is
                log.warning("clean: %s matches no files", spec)
            entries = [(name, info) for name, info in matches.items()]
        elif fs.isdir(p):
            entries = list(fs.find(p, detail=True).items())
        else:
            try:
                info = fs.info(p)
            except FileNotFoundError:
                raise FileNotFoundError(f"{spec}: no such file or directory") from None
            add(fsio._url(fs, p, spec), int(info.get("size") or 0), explicit=True)
            continue
        for name, info in entries:
            if info.get("type") == "directory":
                for sub, subinfo in fs.find(name, detail=True).items():
                    add(fsio._url(fs, sub, spec), int(subinfo.get("size") or 0), explicit=False)
            else:
                add(fsio._url(fs, name, spec), int(info.get("size") or 0), explicit=False)
    return [found[k] for k in sorted(found)], sorted(skipped)


def _filesystem(spec: str):
    """fsio.filesystem, but for a glob resolve the filesystem from the part before the wildcard
    (fsspec expands a remote glob while resolving it and fails when nothing matches)."""
    if not any(c in spec for c in "*?["):
        return fsio.filesystem(spec)
    head = spec[:min(spec.index(c) for c in "*?[" if c in spec)]
    fs, head_path = fsio.filesystem(head or ".")
    if fsio.is_remote(spec):
        return fs, fs._strip_protocol(spec)
    return fs, os.path.abspath(spec)


def _decode(raw: bytes, report: FileReport) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "replace")
        report.invalid_utf8_records += 1
        report.replaced_bytes += text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")
    return text[1:] if text.startswith("\ufeff") else text   # a UTF-8 byte-order mark is not text


def read_records(f: InputFile, cfg, report: FileReport) -> Iterator[Record]:
    """Yield the records of one input file (cfg: CleanConfig). Raises BadInputFile / OSError."""
    if f.size == 0 and f.kind != "parquet":
        report.empty = True
        if f.kind == "text" and not cfg.txt_delimiter:
            yield Record(f.path, "", 0)   # an empty document: the length filter drops it, counted
        return
    if f.kind == "text":
        yield from _read_text(f, cfg, report)
    elif f.kind == "jsonl":
        yield from _read_jsonl(f, cfg, report)
    else:
        yield from _read_parquet(f, cfg, report)


def _read_text(f: InputFile, cfg, report: FileReport) -> Iterator[Record]:
    limit = cfg.max_record_bytes
    if not cfg.txt_delimiter:
        if limit and f.size > limit:
            report.oversized_records += 1
            yield Record(f.path, None, f.size)
            return
        with fsio.open(f.path, "rb") as fh:
            raw = fh.read()
        yield Record(f.path, _decode(raw, report), len(raw))
        return
    delim = cfg.txt_delimiter
    if "\\" in delim:   # a delimiter typed on the command line: --set data.clean.txt_delimiter='\n\n'
        delim = delim.encode("ascii", "backslashreplace").decode("unicode_escape")
    delim = delim.encode("utf-8")
    i = 0
    for raw, n in _split_stream(f.path, delim, limit):
        if raw is None:
            report.oversized_records += 1
            yield Record(f"{f.path}#{i}", None, n)
        elif raw.strip():
            yield Record(f"{f.path}#{i}", _decode(raw, report), n)
        i += 1


def _split_stream(path: str, delim: bytes, limit: int) -> Iterator[tuple[bytes | None, int]]:
    """(piece, bytes) for each delimiter-separated piece, streaming; (None, bytes) when over limit."""
    buf = bytearray()
    skipping = 0   # > 0 while inside an oversized piece: bytes of it seen so far
    with fsio.open(path, "rb") as fh:
        while True:
            block = fh.read(1 << 20)
            if block:
                buf += block
            start = 0
            while (j := buf.find(delim, start)) >= 0:
                if skipping:
                    yield None, skipping + j - start
                    skipping = 0
                else:
                    yield bytes(buf[start:j]), j - start + len(delim)
                start = j + len(delim)
            del buf[:start]
            if not block:
                break
            if limit and (skipping or len(buf) > limit):
                keep = len(delim) - 1   # a delimiter may straddle two blocks
                skipping += len(buf) - keep
                del buf[:len(buf) - keep]
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
    if fsio.is_remote(path):   # fsspec's remote files have no readline(size), which bounds a huge line
        return io.BufferedReader(fh, 1 << 20)
    return fh


class _ZstdReader(io.RawIOBase):
    """Streaming zstd decompression (frames back to back) that reports damage as errors the stage
    records per file: random bytes raise BadInputFile, a stream that ends inside a frame (a
    truncated download) raises EOFError, like gzip does. zstandard's stream_reader returns a silent
    EOF for a truncated frame and raises its own ZstdError for garbage."""

    def __init__(self, path: str, fh):
        import zstandard

        self.path, self.fh, self._zstd = path, fh, zstandard
        self.dobj = zstandard.ZstdDecompressor().decompressobj()
        self.pending = b""
        self.in_frame = False   # fed bytes of a frame that has not ended yet

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self.pending:
            block = self.fh.read(1 << 20)
            if not block:
                if self.in_frame:
                    raise EOFError(f"{self.path}: compressed file ended before the end of its zstd frame (truncated)")
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
            if self.dobj.eof:   # the next frame starts in the leftover bytes
                self.dobj = self._zstd.ZstdDecompressor().decompressobj()


def _read_jsonl(f: InputFile, cfg, report: FileReport) -> Iterator[Record]:
    limit = cfg.max_record_bytes or (1 << 62)
    key = cfg.text_field

    def malformed(lineno: int, why: str) -> None:
        report.malformed_lines += 1
        if len(report.malformed_first) < FIRST_N:
            report.malformed_first.append(f"line {lineno}: {why}")

    with fsio.open(f.path, "rb") as raw_fh:
        fh = _open_decompressed(f.path, raw_fh)
        lineno = 0
        while True:
            line = fh.readline(limit + 1)
            if not line:
                break
            lineno += 1
            if len(line) > limit and not line.endswith(b"\n"):   # a huge line: skip the rest unread
                n = len(line)
                while (rest := fh.readline(1 << 20)):
                    n += len(rest)
                    if rest.endswith(b"\n"):
                        break
                report.oversized_records += 1
                yield Record(f"{f.path}#{lineno}", None, n)
                continue
            if not line.strip():
                continue
            text = _decode(line, report)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                malformed(lineno, f"invalid JSON ({e.msg}, column {e.colno})")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
                got = "not an object" if not isinstance(obj, dict) else (
                    f"no field '{key}' (fields: {', '.join(list(obj)[:10])})" if key not in obj
                    else f"field '{key}' is {type(obj[key]).__name__}, not a string")
                malformed(lineno, got)
                continue
            yield Record(f"{f.path}#{lineno}", obj[key], len(line))


def _read_parquet(f: InputFile, cfg, report: FileReport) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    col = cfg.text_column
    with fsio.open(f.path, "rb") as fh:
        pf = pq.ParquetFile(fh)
        names = pf.schema_arrow.names
        if col not in names:
            raise BadInputFile(f"{f.path}: no column '{col}' (columns: {', '.join(names)}); "
                               f"choose one with --text-column / data.clean.text_column")
        typ = pf.schema_arrow.field(col).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise BadInputFile(f"{f.path}: column '{col}' has type {typ}, expected a string column")
        if pf.metadata.num_rows == 0:
            report.empty = True
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=[col]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    report.null_values += 1
                else:
                    yield Record(f"{f.path}#{row}", text, len(text) if text.isascii() else len(text.encode("utf-8")))
                row += 1
