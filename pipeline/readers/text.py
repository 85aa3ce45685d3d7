"""Text files: one document per file, or documents split on data.clean.txt_delimiter (a string,
blank-lines, or re:REGEX, a line that starts a document), read from a piece's start: a piece that
starts mid-file finds its first record as a reader from the file's start would
(first_record_start). docs/stages.md has the details.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

from codex.core import fsio
from codex.pipeline.readers.record import FileReport, Piece, Record, decode

BLANK_LINES = "blank-lines"  # --txt-delimiter blank-lines: lines holding only white space
REGEX = "re:"  # --txt-delimiter 're:^// FILE: ': a line where the regex matches starts a document


@functools.lru_cache(maxsize=64)
def split_regex(delim: str, key: str = "data.clean.txt_delimiter") -> re.Pattern[bytes] | None:
    """The compiled pattern of a delimiter 're:REGEX' (None for any other delimiter); a bad
    regex is a ValueError naming `key`, the setting it came from."""
    if not delim.startswith(REGEX):
        return None
    pattern = delim[len(REGEX) :]
    if not pattern:
        raise ValueError(f"{key}: {delim!r} holds no regex after 're:'")
    try:
        return re.compile(pattern.encode("utf-8"), re.MULTILINE)
    except re.error as e:
        raise ValueError(f"{key}: {delim!r} is not a valid regular expression: {e}") from None


def text_delimiter(delim: str) -> bytes:
    """data.clean.txt_delimiter as bytes; escapes typed on the command line (--txt-delimiter
    '\\n\\n') are understood."""
    if "\\" in delim:
        delim = delim.encode("ascii", "backslashreplace").decode("unicode_escape")
    return delim.encode("utf-8")


def read_text(piece: Piece, cfg, report: FileReport) -> Iterator[Record]:
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
        yield Record(f.path, decode(raw, report), len(raw))
        return
    if setting == BLANK_LINES:
        with fsio.open(f.path, "rb") as fh:
            for at, raw, n in _blank_line_records(fh, piece, limit):
                if raw is None:
                    report.oversized_records += 1
                    yield Record(f"{f.path}@{at}", None, n)
                else:
                    yield Record(f"{f.path}@{at}", decode(raw, report), n)
        return
    pattern = split_regex(setting)
    if pattern is not None:
        with fsio.open(f.path, "rb") as fh:
            for at, raw, n in _regex_records(fh, piece, pattern, limit):
                if raw is None:
                    report.oversized_records += 1
                    yield Record(f"{f.path}@{at}", None, n)
                elif raw.strip():
                    yield Record(f"{f.path}@{at}", decode(raw, report), n)
        return
    delim = text_delimiter(setting)
    with fsio.open(f.path, "rb") as fh:
        first = first_record_start(fh, piece.start, delim)
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
                yield Record(f"{f.path}@{pos}", decode(raw, report), n)
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


def _regex_records(
    fh, piece: Piece, pattern: re.Pattern[bytes], limit: int
) -> Iterator[tuple[int, bytes | None, int]]:
    """--txt-delimiter 're:REGEX': a line where `pattern` matches (anywhere in it, as grep does;
    its first MB for a longer line) starts a document and is its first line; the text before the
    first such line is a document too. Yields (start byte, text or None when over `limit`,
    bytes) for the documents that start in the piece. Whether a line starts one depends on that
    line alone, so a piece from mid-file skips to its first line start and finds the same
    documents a reader from the file's start does."""
    start, end = piece.start, piece.end if piece.end >= 0 else 1 << 62
    if start:
        newline = next(_occurrences(fh, start - 1, b"\n"), None)
        if newline is None:
            return
        pos, at = newline + 1, -1  # the rest of a document an earlier piece reads
    else:
        pos, at = 0, 0
    size = 0  # the open document (from `at`; -1: none): its bytes, its text (None: over limit)
    parts: list[bytes] | None = []
    fh.seek(pos)
    line_start = True  # whether the next block starts a line (a longer line comes in blocks)
    search = pattern.search
    for block in iter(functools.partial(fh.readline, 1 << 20), b""):
        if line_start:
            if at < 0 and pos >= end:
                return  # no document starts in the piece
            if search(block.removesuffix(b"\n").removesuffix(b"\r")):
                if at >= 0 and size:
                    yield at, (b"".join(parts) if parts is not None else None), size
                if pos >= end:
                    return
                at, parts, size = pos, [], 0
        line_start = block.endswith(b"\n")
        n = len(block)
        pos += n
        if at >= 0:
            size += n
            if parts is not None:
                parts.append(block)
                if limit and size > limit:
                    parts = None  # over max_record_bytes: count it, keep none of it
    if at >= 0 and size:
        yield at, (b"".join(parts) if parts is not None else None), size


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


def first_record_start(fh, start: int, delim: bytes) -> int | None:
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
