"""What clean's readers take and give: an input file (InputFile) or a piece of one (Piece), its
records (Record) and what went wrong in it (FileReport, BadInputFile). docs/bad-input.md says how
bad input is counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

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
    source: str = ""  # the source it is counted under (pipeline/inputs.py: source_names)
    # a local link: the real path it leads to ("" when it leads nowhere: dangling, a cycle; None
    # when the file is no link), and why it is not read ("" when it is). docs/bad-input.md
    link: str | None = None
    not_read: str = ""

    @property
    def unreadable(self) -> bool:
        """A link that leads nowhere: it fails the run unless data.clean.skip_unreadable_links."""
        return self.link == ""

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


def meta_value(v) -> str | None:
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
    skipped_link: str = ""  # a link not read, and why (InputFile.not_read)
    unreadable_link: bool = False  # the error: a link that leads nowhere (InputFile.unreadable)
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
            or self.skipped_link
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
        if self.dropped_whole:
            parts.append(f"the whole file was one document, dropped by {self.dropped_whole}")
        if self.skipped_link:
            parts.append(f"not read: {self.skipped_link}")
        if self.error:
            parts.append(self.error)
        return ", ".join(parts)


def decode(raw: bytes, report: FileReport) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "replace")
        report.invalid_utf8_records += 1
        report.replaced_bytes += text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")
    return text[1:] if text.startswith("\ufeff") else text  # a UTF-8 byte-order mark is not text
