"""`codex data clean` on bad input, through the real CLI (tests/fixtures/bad_input.py: invoke):
damaged, empty, binary or unreadable files, JSONL without its field, a low yield, whole files
dropped by a rule, delimiters, sources files, a killed run's temp files.
Policy: docs/bad-input.md."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import zstandard

from codex.core.config import build_config
from tests.fixtures.bad_input import files_under, invoke, warnings_with
from tests.fixtures.clean import clean_stats, kept_rows, prose


def _zst_lines(n: int, start: int = 0) -> bytes:
    return zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": prose(i)}) + "\n" for i in range(start, start + n)).encode()
    )


def _clean(run: Path, *args: str) -> list[str]:
    return ["data", "clean", "--run", str(run), *args]


def test_a_txt_file_over_max_chars_fails_naming_the_rule_and_the_delimiter_option(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(prose(i) for i in range(6)))
    small = "--set=data.clean.length.max_chars=2000"  # stands in for the 1 MB default
    invoke(
        ["data", "clean", "--run", str(tmp_path / "r1"), "--input", str(book), small],
        1,
        "kept no documents",
        "length:too_long",
        "--txt-delimiter",
    )
    assert (
        not (tmp_path / "r1" / "clean" / "stats.json").exists()
        or json.loads((tmp_path / "r1" / "clean" / "stats.json").read_text())["docs_out"] == 0
    )
    invoke(
        [
            "data",
            "clean",
            "--run",
            str(tmp_path / "r2"),
            "--input",
            str(book),
            small,
            "--txt-delimiter",
            r"\n\n",
        ],
        0,
    )
    assert json.loads((tmp_path / "r2" / "clean" / "stats.json").read_text())["docs_out"] == 6


def test_a_delimiter_of_real_newlines_iskept_rows():
    cfg = build_config(overrides=["data.clean.txt_delimiter=\n\n"])
    assert cfg.data.clean.txt_delimiter == "\n\n"


def test_a_rule_that_drops_most_documents_is_named_with_its_switch(tmp_path, caplog):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (src / f"good{i}.txt").write_text(prose(i))
    for i in range(5):
        (src / f"short{i}.txt").write_text(f"just a few words, number {i}.")
    with caplog.at_level(logging.WARNING):
        invoke(["data", "clean", "--run", str(tmp_path / "r"), "--input", str(src)], 0)
    assert "gopher_quality:short_doc dropped 5 of 7 documents" in caplog.text
    assert "--set data.clean.gopher_quality.enabled=false" in caplog.text


@pytest.mark.parametrize(
    "damage, pattern", [("random", "not a valid zstd stream"), ("truncated", "truncated")]
)
def test_a_damaged_zst_fails_alone_and_later_stages_refuse_the_partial_corpus(
    tmp_path, damage, pattern, caplog
):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl.zst").write_bytes(_zst_lines(4))
    whole = _zst_lines(30, start=4)
    (src / "g.jsonl.zst").write_bytes(
        np.random.default_rng(0).bytes(5000) if damage == "random" else whole[: len(whole) // 2]
    )
    run = str(tmp_path / "r")
    with caplog.at_level(logging.WARNING):
        invoke(
            ["data", "clean", "--run", run, "--input", str(src)],
            1,
            "1 input file(s) failed",
            "g.jsonl.zst",
            pattern,
        )
    # no stray ", "
    assert "clean: bad input (details in stats.json): 1 failed files" in caplog.text
    stats = json.loads((tmp_path / "r" / "clean" / "stats.json").read_text())
    assert stats["docs_out"] == 4  # the good file was cleaned
    assert [f["path"] for f in stats["bad_input"]["failed_files"]] == [str(src / "g.jsonl.zst")]
    invoke(["data", "tokenize", "--run", run], 1, "clean did not finish", "g.jsonl.zst")
    # a tokenizer from the files given
    invoke(
        [
            "data",
            "tokenize",
            "--run",
            run,
            "--input",
            str(tmp_path / "r" / "clean" / "part-*.parquet"),
            "--vocab-size",
            "300",
        ],
        0,
    )
    invoke(["data", "shard", "--run", run], 1, "clean did not finish", "g.jsonl.zst")
    assert not (tmp_path / "r" / "shards" / "manifest.json").exists()


def test_jsonl_without_the_text_field_says_which_field(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text("".join(json.dumps({"body": prose(i)}) + "\n" for i in range(3)))
    invoke(
        ["data", "clean", "--run", str(tmp_path / "r"), "--input", str(f)],
        1,
        "no document was read",
        "no field 'text'",
        "--text-field",
    )


@pytest.mark.parametrize(
    "args, code, pattern",
    [
        (["--input", "/nonexistent/in.jsonl"], 2, "/nonexistent/in.jsonl: no such file"),
        (["--input", "{tmp}/x.bin"], 2, "unsupported file type"),
        (["--input", "{tmp}/p.parquet"], 1, "no column 'text'"),
        (["--input", "{tmp}/p.parquet", "--workers", "-1"], 2, "data.clean.workers=-1"),
        (
            ["--input", "{tmp}/p.parquet", "--num-tasks", "2", "--task-index", "3"],
            2,
            "task_index=3",
        ),
        (
            ["--input", "{tmp}/p.parquet", "--set", "data.clean.preset=prose"],
            2,
            "data.clean.preset",
        ),
    ],
)
def test_clean_usage_and_unusable_files(tmp_path, args, code, pattern):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "x.bin").write_bytes(b"\0")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "p.parquet")
    invoke(
        ["data", "clean", "--run", str(tmp_path / "r"), *[a.format(tmp=tmp_path) for a in args]],
        code,
        pattern,
    )


def test_an_empty_input_file_keeps_nothing_and_is_named(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    run = tmp_path / "r"
    invoke(_clean(run, "--input", str(f)), 1, "kept no documents", "empty.txt")
    invoke(["data", "tokenize", "--run", str(run)], 1, "kept no documents")
    assert not (run / "tokenizer").exists()


def test_a_binary_file_named_txt_is_reported_and_kept_out(tmp_path, caplog):
    src = tmp_path / "in"
    src.mkdir()
    (src / "good.txt").write_text(prose(1))
    (src / "blob.txt").write_bytes(np.random.default_rng(0).bytes(3000))
    run = tmp_path / "r"
    # the blob is most of the input's bytes: kept out, it leaves the run under min_source_yield
    with caplog.at_level(logging.WARNING):
        invoke(_clean(run, "--input", str(src), "--set=data.clean.min_source_yield=0"), 0)
    assert warnings_with(caplog, str(src / "blob.txt"), "invalid UTF-8")
    assert {r["source"] for r in kept_rows(run)} == {str(src / "good.txt")}


def test_non_utf8_bytes_in_a_jsonl_line_are_counted_and_named(tmp_path, caplog):
    f = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": prose(i)}).encode() for i in range(3)]
    lines[1] = lines[1].replace(b"valley", b"vall\xff\xfeey", 1)
    f.write_bytes(b"\n".join(lines) + b"\n")
    run = tmp_path / "r"
    with caplog.at_level(logging.WARNING):
        invoke(_clean(run, "--input", str(f)), 0)
    bad = clean_stats(run)["bad_input"]["invalid_utf8_records"]
    assert bad["count"] == 1 and bad["first_files"] == [str(f)]
    assert warnings_with(caplog, str(f), "invalid UTF-8 in 1 records")
    assert len(kept_rows(run)) == 3  # the line is kept, its two bytes replaced


def test_a_jsonl_line_that_is_an_array_is_skipped_and_named(tmp_path, caplog):
    f = tmp_path / "docs.jsonl"
    good = [json.dumps({"text": prose(i)}) for i in range(3)]
    f.write_text("\n".join([good[0], json.dumps([prose(9)]), *good[1:]]) + "\n")
    run = tmp_path / "r"
    with caplog.at_level(logging.WARNING):
        invoke(_clean(run, "--input", str(f)), 0)
    stats = clean_stats(run)
    assert stats["docs_out"] == 3
    assert stats["bad_input"]["malformed_lines"]["first"] == [
        {"path": str(f), "lines": ["line 2: not an object"]}
    ]
    assert warnings_with(caplog, str(f), "line 2: not an object")
    # a file of arrays only: nothing was read, and the line (and its file) is named
    g = tmp_path / "arrays.jsonl"
    g.write_text(json.dumps([prose(1)]) + "\n")
    invoke(
        _clean(tmp_path / "r2", "--input", str(g)),
        1,
        "no document was read",
        "arrays.jsonl",
        "line 1: not an object",
    )


def test_a_truncated_parquet_input_fails_alone_naming_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "in"
    src.mkdir()
    (src / "good.txt").write_text(prose(1))
    p = src / "cut.parquet"
    pq.write_table(pa.table({"text": [prose(i) for i in range(2, 8)]}), p)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    run = tmp_path / "r"
    invoke(_clean(run, "--input", str(src)), 1, "1 input file(s) failed", str(p))
    assert {r["source"] for r in kept_rows(run)} == {str(src / "good.txt")}
    invoke(["data", "tokenize", "--run", str(run)], 1, "clean did not finish", str(p))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_an_unreadable_input_file_fails_alone_naming_it(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "good.txt").write_text(prose(1))
    locked = src / "locked.txt"
    locked.write_text(prose(2))
    locked.chmod(0)
    try:
        invoke(
            _clean(tmp_path / "r", "--input", str(src)),
            1,
            "1 input file(s) failed",
            str(locked),
            "Permission denied",
        )
    finally:
        locked.chmod(0o644)
    assert {r["source"] for r in kept_rows(tmp_path / "r")} == {str(src / "good.txt")}


def test_a_whole_file_dropped_by_a_length_rule_is_named_with_its_switch(tmp_path, caplog):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        (src / f"small{i}.txt").write_text(prose(i))
    big = src / "big.txt"
    big.write_text("\n\n".join(prose(i) for i in range(10, 16)))  # over the 2000 below
    run = tmp_path / "r"
    with caplog.at_level(logging.WARNING):
        invoke(_clean(run, "--input", str(src), "--set=data.clean.length.max_chars=2000"), 0)
    (warned,) = warnings_with(caplog, "dropped whole")
    assert str(big) in warned and "--txt-delimiter blank-lines" in warned
    assert "small0.txt" not in warned
    whole = clean_stats(run)["bad_input"]["whole_files_dropped"]
    assert whole == [{"path": str(big), "reason": "length:too_long"}]


def test_a_low_yield_clean_exits_1_until_allow_low_yield(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "small.txt").write_text(prose(1))
    (src / "book.txt").write_text("\n\n".join(prose(i) for i in range(2, 202)))  # ~125 kB
    run = tmp_path / "r"
    args = _clean(run, "--input", str(src), "--set=data.clean.length.max_chars=2000")
    invoke(args, 1, "clean kept 0.", "min_yield=0.01", "length:too_long", "--allow-low-yield")
    invoke(["data", "tokenize", "--run", str(run)], 1, "--allow-low-yield")
    assert not (run / "tokenizer").exists()
    markers = files_under(run / "clean" / "markers")
    invoke([*args, "--allow-low-yield"], 0)
    assert "low_yield" not in clean_stats(run) and clean_stats(run)["docs_out"] == 1
    assert files_under(run / "clean" / "markers") == markers  # nothing was cleaned again


def test_blank_lines_holding_white_space_split_documents(tmp_path):
    paras = [prose(i).replace("\n", " ") for i in range(4)]
    f = tmp_path / "wiki.txt"
    # separators: a line of spaces, a tab line then a space line, a CRLF blank line; blank lines
    # at both ends. Not one of them is the two characters '\n\n'.
    f.write_bytes(
        (
            "  \n"
            + paras[0]
            + "\n \n"
            + paras[1]
            + "\n\t\n   \n"
            + paras[2]
            + "\r\n\r\n"
            + paras[3]
            + "\n  \n"
        ).encode()
    )
    invoke(_clean(tmp_path / "b", "--input", str(f), "--txt-delimiter", "blank-lines"), 0)
    assert sorted(r["text"].strip() for r in kept_rows(tmp_path / "b")) == sorted(paras)
    quality = [f"--set=data.clean.{f}.enabled=false" for f in ("gopher_repetition", "fineweb")]
    invoke(
        _clean(
            tmp_path / "n",
            "--input",
            str(f),
            "--txt-delimiter",
            r"\n\n",
            "--set=data.clean.length.max_chars=3000",
            *quality,
        ),
        0,
    )
    assert clean_stats(tmp_path / "n")["docs_in"] == 1  # '\n\n' never matched: one document


@pytest.mark.parametrize(
    "content, code, patterns",
    [
        (None, 2, ["sources.yaml", "No such file"]),
        ("- {input: a.txt\n", 2, ["sources.yaml line 2", "invalid YAML"]),
        ("input: a.txt\n", 2, ["sources.yaml", "want a YAML list"]),
        (
            "- {input: '{src}', presets: code}\n",
            2,
            ["data.clean.sources[0]: unknown key 'presets'"],
        ),
        ("- {input: '{src}', preset: prose}\n", 2, ["data.clean.sources[0].preset: 'prose'"]),
        ("- {preset: code}\n", 2, ["data.clean.sources[0]: needs 'input: PATH'"]),
        (
            "- {input: '{src}', allow_low_yield: maybe}\n",
            2,
            ["data.clean.sources[0].allow_low_yield: 'maybe' is not true or false"],
        ),
        ("- {input: '{src}'}\n- {input: '{tmp}/gone.txt'}\n", 2, ["gone.txt: no such file"]),
    ],
)
def test_a_sources_file_with_bad_content_is_a_usage_error_naming_it(
    tmp_path, content, code, patterns
):
    src = tmp_path / "src.txt"
    src.write_text(prose(1))
    sources = tmp_path / "sources.yaml"
    if content is not None:
        sources.write_text(content.replace("{src}", str(src)).replace("{tmp}", str(tmp_path)))
    run = tmp_path / "r"
    invoke(_clean(run, "--sources", str(sources)), code, *patterns)
    assert not run.exists()  # refused before anything was written


def test_a_rerun_of_clean_removes_the_temp_files_a_killed_run_left(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        (src / f"d{i}.txt").write_text(prose(i))
    run = tmp_path / "r"
    invoke(_clean(run, "--input", str(src)), 0)
    clean = run / "clean"
    parts = {p.name: p.read_bytes() for p in clean.glob("part-*.parquet")}
    debris = [
        clean / ".tmp-part-000000-000.parquet.k1x2",  # what kill -9 during a part write leaves
        clean / ".tmp-stats.json.q9",
        clean / "markers" / ".tmp-000000.json.zz",
        clean / "hashes" / ".tmp-000000.npy.a8",
    ]
    for d in debris:
        d.parent.mkdir(exist_ok=True)
        d.write_bytes(b"partial")
    invoke(_clean(run, "--input", str(src)), 0)
    assert [d.name for d in debris if d.exists()] == []
    assert parts and {p.name: p.read_bytes() for p in clean.glob("part-*.parquet")} == parts


def test_a_jsonl_record_over_the_limit_gets_the_record_fixes_not_the_text_delimiter(tmp_path):
    """--txt-delimiter splits text files only: the fixes for a .jsonl's dropped records start
    with the limits, whether some documents are kept (a low yield) or none is."""
    big = json.dumps({"text": prose(0) * 200})  # ~130 kB, over the limit below
    small = "--set=data.clean.max_record_bytes=100000"
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join([big, json.dumps({"text": prose(1)})]) + "\n")
    out = invoke(_clean(tmp_path / "r1", "--input", str(mixed), small), 1, "clean kept 0.")
    (error,) = [line for line in out.splitlines() if line.startswith("Error:")]
    assert "fix for length:too_long: a .jsonl line is one document: raise" in error
    assert "max_record_bytes" in error and "--txt-delimiter" not in error
    alone = tmp_path / "alone.jsonl"
    alone.write_text(big + "\n")  # one record, the whole file: not a text file dropped whole
    out = invoke(_clean(tmp_path / "r2", "--input", str(alone), small), 1, "kept no documents")
    assert "a .jsonl line is one document" in out and "--txt-delimiter" not in out
    assert clean_stats(tmp_path / "r2")["bad_input"]["whole_files_dropped"] == []


def test_the_length_fixes_follow_the_formats_the_rule_dropped_bytes_from():
    from codex.pipeline.clean.stats import drop_fix, rule_kinds

    stats = {"drop_kinds": {"length:too_long": {"text": 10, "jsonl": 500}}}
    kinds = rule_kinds(stats, "length", "too_long")
    assert kinds == ["jsonl", "text"]
    fix = drop_fix("length", "too_long", kinds)
    assert fix.startswith("a .jsonl line is one document: raise data.clean.length.max_chars")
    assert fix.index("max_record_bytes") < fix.index("--txt-delimiter")  # text files: second
    assert drop_fix("length", "too_long", ["parquet"]).startswith("a .parquet row")
    text_first = drop_fix("length", "too_long", ["text", "jsonl"])
    assert text_first.startswith("a text file is one document unless split: pass --txt-delimiter")
    assert drop_fix("length", "too_long") == text_first  # stats written before formats counted
