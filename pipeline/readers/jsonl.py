""".jsonl, .jsonl.gz and .jsonl.zst: one JSON object a line, its text in a field. clean's records
(read_jsonl: a malformed line skipped and counted) and the texts of tokenize and shard
(jsonl_texts: a malformed line raises BadInputFile).
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator

from codex.core import fsio
from codex.pipeline.readers.record import (
    FIRST_N,
    BadInputFile,
    FileReport,
    Piece,
    Record,
    decode,
    meta_fields,
    meta_value,
)
from codex.pipeline.readers.text import first_record_start


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


def read_jsonl(piece: Piece, cfg, report: FileReport) -> Iterator[Record]:
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
        pos = first_record_start(fh, piece.start, b"\n") if piece.start else 0
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
            text = decode(line, report)
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
            meta = {k: meta_value(obj.get(k)) for k in fields} if fields else None
            yield Record(f"{f.path}@{at}", obj[key], len(line), meta)


def jsonl_texts(path: str, key: str, batch_rows: int) -> Iterator[list]:
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
