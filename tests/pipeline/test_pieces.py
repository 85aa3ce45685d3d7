"""Pieces of one input file read by separate workers give exactly the records of one reader.

A piece takes the records that start inside its byte range (or its row groups); the cut points
must never change a record, including for a self-overlapping delimiter ('\\n\\n' in a run of
newlines) where a reader starting mid-file could align its matches differently."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codex.core.config import build_config
from codex.pipeline.clean import plan as clean_plan
from codex.pipeline.clean.plan import plan_units
from codex.pipeline.readers import FileReport, InputFile, Piece, read_records


def records(piece_or_file, cfg) -> list[tuple[str, str | None, int]]:
    return [(r.id, r.text, r.nbytes) for r in read_records(piece_or_file, cfg, FileReport("x"))]


def cut(f: InputFile, points: list[int]) -> list[Piece]:
    bounds = [0, *sorted(set(points)), f.size]
    return [Piece(f, a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@pytest.mark.slow
@pytest.mark.parametrize("delim", ["\\n\\n", "\n", "abab", "<|endoftext|>", "aa"])
def test_delimited_text_pieces_equal_one_reader(tmp_path, delim):
    cfg = build_config(overrides=[f"data.clean.txt_delimiter={delim}"]).data.clean
    raw = delim.encode().decode("unicode_escape") if "\\" in delim else delim
    rng = random.Random(7)
    alphabet = ["a", "b", "x ", "\n", raw, raw + raw[:1], raw * 3, "é"]
    for case in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 120)))
        path = tmp_path / f"c{case}.txt"
        path.write_bytes(text.encode())
        f = InputFile(str(path), path.stat().st_size, "text")
        whole = records(f, cfg)
        for _ in range(6):
            points = (
                [rng.randrange(1, f.size) for _ in range(rng.randrange(1, 5))] if f.size > 1 else []
            )
            got = [r for p in cut(f, points) for r in records(p, cfg)]
            assert got == whole, (text, points)
        # every single cut point
        for point in range(1, f.size):
            assert [r for p in cut(f, [point]) for r in records(p, cfg)] == whole, (text, point)


def test_jsonl_pieces_equal_one_reader_with_bad_and_oversized_lines(tmp_path):
    cfg = build_config(overrides=["data.clean.max_record_bytes=300"]).data.clean
    rng = random.Random(3)
    lines = []
    for i in range(300):
        kind = rng.random()
        if kind < 0.05:
            lines.append("{not json")
        elif kind < 0.1:
            lines.append(json.dumps({"text": "y" * 400}))  # over max_record_bytes
        elif kind < 0.15:
            lines.append("")
        else:
            lines.append(json.dumps({"text": f"doc {i} " + "z" * rng.randrange(0, 50)}))
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n")
    f = InputFile(str(path), path.stat().st_size, "jsonl")
    whole_report = FileReport("x")
    whole = [(r.id, r.text, r.nbytes) for r in read_records(f, cfg, whole_report)]
    assert len(whole) > 200 and any(t is None for _, t, _ in whole)
    for k in range(30):
        points = [rng.randrange(1, f.size) for _ in range(k % 7 + 1)]
        reports = []
        got = []
        for p in cut(f, points):
            reports.append(FileReport("x"))
            got += [(r.id, r.text, r.nbytes) for r in read_records(p, cfg, reports[-1])]
        assert got == whole
        assert sum(r.malformed_lines for r in reports) == whole_report.malformed_lines > 0
        assert sum(r.oversized_records for r in reports) == whole_report.oversized_records > 0


def test_parquet_row_group_pieces_and_the_plan(tmp_path):
    texts = [f"document number {i} " * (1 + i % 5) for i in range(1000)]
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=50)
    f = InputFile(str(path), path.stat().st_size, "parquet")
    cfg = build_config(overrides=[f"data.clean.chunk_bytes={f.size // 5}"]).data.clean
    units = plan_units([f], cfg)
    assert len(units) >= 4 and all(len(u.pieces) == 1 for u in units)
    got = [r for u in units for r in records(u.pieces[0], cfg)]
    assert got == records(f, cfg)
    assert [t for _, t, _ in got] == texts and got[57][0] == f"{path}#57"


def test_plan_cuts_big_files_and_packs_small_ones(tmp_path):
    small = []
    for i in range(3):
        p = tmp_path / f"s{i}.jsonl"
        p.write_text(json.dumps({"text": "x" * 100}) + "\n")
        small.append(InputFile(str(p), p.stat().st_size, "jsonl"))
    big = tmp_path / "z.jsonl"
    big.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(5000)))
    gz = InputFile(str(tmp_path / "y.jsonl.gz"), 10**6, "jsonl")
    files = [*small, gz, InputFile(str(big), big.stat().st_size, "jsonl")]
    cfg = build_config(overrides=["data.clean.chunk_bytes=20000"]).data.clean
    units = plan_units(files, cfg)
    # small files packed into one unit, the gzip file whole (cannot be split), the big one cut:
    # the corpus's last 2 x chunk_bytes (TAIL_CHUNKS) in units of a quarter chunk
    assert [len(u.pieces) for u in units[:2]] == [3, 1] and units[1].pieces[0] == Piece(gz)
    size = big.stat().st_size
    bounds = [units[2].pieces[0].start] + [u.pieces[0].end for u in units[2:]]
    assert bounds[0] == 0 and bounds[-1] == size and bounds == sorted(set(bounds))
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert clean_plan.TAIL_CHUNKS == 2 and (size - 40000) in bounds
    assert len(lengths) == -(-(size - 40000) // 20000) + 8
    assert all(x <= 20000 for x in lengths) and all(x <= 5000 for x in lengths[-8:])
    assert [u.index for u in units] == list(range(len(units)))


def test_blank_lines_pieces_equal_one_reader(tmp_path):
    """--txt-delimiter blank-lines: lines holding only spaces or tabs separate documents too
    (WikiText's blank lines hold a space), at every cut point."""
    cfg = build_config(overrides=["data.clean.txt_delimiter=blank-lines"]).data.clean
    rng = random.Random(11)
    lines = ["word one\n", "two words here\n", " \n", "\t \n", "\n", "\r\n", "x", "  lead\n", "é\n"]
    for case in range(40):
        text = "".join(rng.choice(lines) for _ in range(rng.randrange(1, 40)))
        path = tmp_path / f"b{case}.txt"
        path.write_bytes(text.encode())
        f = InputFile(str(path), path.stat().st_size, "text")
        whole = records(f, cfg)
        # the reference: split on lines that are blank after stripping, drop empty documents
        docs, current = [], []
        for line in text.splitlines(keepends=True):
            if line.strip():
                current.append(line)
            elif current:
                docs.append("".join(current).removesuffix("\n"))
                current = []
        if current:
            docs.append("".join(current).removesuffix("\n"))
        assert [t for _, t, _ in whole] == docs, text
        for point in range(1, f.size):
            assert [r for p in cut(f, [point]) for r in records(p, cfg)] == whole, (text, point)


def test_blank_lines_split_wikitext_style_paragraphs(tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_text(
        " = Title = \n \n First paragraph , one line . \n \n Second one . \nstill two\n"
    )
    cfg = build_config(overrides=["data.clean.txt_delimiter=blank-lines"]).data.clean
    got = [t for _, t, _ in records(InputFile(str(path), path.stat().st_size, "text"), cfg)]
    assert got == [" = Title = ", " First paragraph , one line . ", " Second one . \nstill two"]


def test_regex_delimiter_pieces_equal_one_reader(tmp_path):
    """--txt-delimiter 're:REGEX': a line the regex matches starts a document and stays its first
    line; the text before the first one is a document; records over max_record_bytes are counted,
    not held; at every cut point, each document is read once."""
    cfg = build_config(
        overrides=["data.clean.txt_delimiter=re:^// FILE: ", "data.clean.max_record_bytes=60"]
    ).data.clean
    rng = random.Random(5)
    lines = ["// FILE: a.c\n", "int x;\n", "\n", "  // FILE: not at the start\n", "é\r\n", "y"]
    lines += ["// FILE: b.c\r\n", "z" * 70 + "\n"]
    for case in range(20):
        text = "".join(rng.choice(lines) for _ in range(rng.randrange(1, 20)))
        path = tmp_path / f"r{case}.txt"
        path.write_bytes(text.encode())
        f = InputFile(str(path), path.stat().st_size, "text")
        whole = records(f, cfg)
        # the reference: a new document at each line starting "// FILE: ", blank ones dropped
        docs: list[list[str]] = [[]]
        for line in text.splitlines(keepends=True):
            if line.startswith("// FILE: ") and docs[-1]:
                docs.append([])
            docs[-1].append(line)
        want = ["".join(d) for d in docs if "".join(d).strip()]
        assert [t if t is not None else "" for _, t, _ in whole] == [
            d if len(d.encode()) <= 60 else "" for d in want
        ], text
        assert sum(n for _, _, n in whole) == f.size - sum(
            len("".join(d).encode()) for d in docs if not "".join(d).strip()
        )
        for point in range(1, f.size):
            assert [r for p in cut(f, [point]) for r in records(p, cfg)] == whole, (text, point)
