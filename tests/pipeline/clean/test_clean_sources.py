"""`codex data clean` per source, through the real CLI (tests/fixtures/bad_input.py: invoke): the
summary that ends every clean, data.clean.min_source_yield and its switches, the warnings' reasons,
and a concatenated code file split on a regex ('re:'). docs/stages.md, "clean"."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.fixtures.bad_input import files_under, invoke, warnings_with
from tests.fixtures.clean import c_files, clean_stats, kept_rows, prose, spaced

SMALL = "--set=data.clean.length.max_chars=1500"  # stands in for the 1 MB default
SPDX = "// SPDX-License-Identifier: GPL-2.0"


def _clean(run: Path, *args: str) -> list[str]:
    return ["data", "clean", "--run", str(run), SMALL, *args]


def _infos(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "codex.clean")


def _two_sources(tmp_path: Path, code_keys: str = "") -> tuple[Path, Path, Path]:
    """A WikiText-like prose file (3 paragraphs kept, 5 dropped by below_alpha_threshold: about
    a third of its bytes kept) and a concatenated C file that is one document over SMALL."""
    wiki = tmp_path / "wiki.valid.txt"
    wiki.write_text("\n \n".join([prose(i) for i in range(3)] + [spaced(i) for i in range(3, 8)]))
    code = tmp_path / "linux-train.txt"
    code.write_text(c_files(10))
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        f"- {{input: '{wiki}', txt_delimiter: blank-lines}}\n"
        f"- {{input: '{code}', preset: code{code_keys}}}\n"
    )
    return wiki, code, sources


def test_a_source_under_min_source_yield_fails_naming_it_until_its_switch(tmp_path, caplog):
    wiki, code, sources = _two_sources(tmp_path)
    run = tmp_path / "r"
    with caplog.at_level(logging.INFO):
        invoke(
            _clean(run, "--sources", str(sources)),
            1,
            f"source {code} kept 0.0% of its bytes",
            "data.clean.min_source_yield=0.2",
            "length:too_long took 100.0%",
            "txt_delimiter: 're:REGEX'",  # the fix that splits concatenated code
            "allow_low_yield: true in its sources.yaml entry",
        )
    stats = clean_stats(run)
    assert stats["low_source_yield"] == {"min": 0.2, "sources": [str(code)]}
    rows = {r["source"]: r for r in stats["sources"]}
    assert (rows[str(wiki)]["docs_in"], rows[str(wiki)]["docs_kept"]) == (8, 3)
    assert next(iter(rows[str(wiki)]["drop_bytes"])) == "gopher_quality:below_alpha_threshold"
    assert rows[str(code)]["drop_bytes"] == {"length:too_long": code.stat().st_size}
    assert sum(r["docs_in"] for r in rows.values()) == stats["docs_in"]
    # every warning says why; a count agrees with the files it lists
    (bad,) = warnings_with(caplog, "bad input in", str(code))
    assert bad.endswith("the whole file was one document, dropped by length:too_long")
    (starved,) = warnings_with(caplog, "kept under 1% of their bytes")
    assert "1 input file(s)" in starved and str(code) in starved and str(wiki) not in starved
    invoke(["data", "tokenize", "--run", str(run)], 1, "min_source_yield")
    markers = files_under(run / "clean" / "markers")
    caplog.clear()
    _two_sources(tmp_path, ", allow_low_yield: true")
    with caplog.at_level(logging.INFO):
        invoke(_clean(run, "--sources", str(sources)), 0)
    assert files_under(run / "clean" / "markers") == markers  # no unit was cleaned again
    assert "low_source_yield" not in clean_stats(run)
    summary = _infos(caplog).split("summary by source")[1]
    assert f"{wiki}: documents 8 -> 3" in summary and f"{code}: documents 1 -> 0" in summary
    assert summary.index("gopher_quality:below_alpha_threshold") < summary.index(str(code))
    assert "max_non_alpha_words_ratio" in summary  # the rule's own threshold, with the rule
    assert summary.index(str(code)) < summary.index("length:too_long")


def test_min_source_yield_holds_a_single_input_run_and_a_rerun_allowing_it_resumes(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join([prose(0)] + [spaced(i) for i in range(1, 8)]))  # ~10% kept
    run = tmp_path / "r"
    args = _clean(run, "--input", str(book), "--txt-delimiter", "blank-lines")
    out = invoke(args, 1, f"source {book} kept", "gopher_quality:below_alpha_threshold took")
    assert "rerun with --allow-low-yield" in out and "sources.yaml" not in out
    markers = files_under(run / "clean" / "markers")
    invoke([*args, "--set=data.clean.min_source_yield=0.05"], 0)
    invoke([*args, "--allow-low-yield"], 0)
    assert files_under(run / "clean" / "markers") == markers
    assert clean_stats(run)["sources"][0]["low_yield_allowed"] is True


def test_the_summary_ends_every_clean_a_finished_one_again_too(tmp_path, caplog):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        (src / f"d{i}.txt").write_text(prose(i))
    (src / "copy.txt").write_text(prose(0))
    run = tmp_path / "r"
    for _ in range(2):  # the second run finds everything done
        caplog.clear()
        with caplog.at_level(logging.INFO):
            invoke(_clean(run, "--input", str(src)), 0)
        lines = _infos(caplog).splitlines()
        at = next(i for i, line in enumerate(lines) if "summary by source" in line)
        assert lines[at + 1].startswith(f"clean:   {src}: documents 4 -> 3, bytes ")
        assert "(75.0% kept)" in lines[at + 1]
        assert "dedup:duplicate: 1 documents" in lines[at + 2]


@pytest.mark.parametrize(
    "args, patterns",
    [
        (
            ["--txt-delimiter", "re:(unclosed"],
            ["data.clean.txt_delimiter: 're:(unclosed'", "not a"],
        ),
        (["--txt-delimiter", "re:"], ["data.clean.txt_delimiter: 're:' holds no regex"]),
        (["--sources", "{sources}"], ["data.clean.sources[0].txt_delimiter: 're:[a-'", "not a"]),
    ],
)
def test_a_bad_regex_delimiter_is_a_usage_error_naming_its_key(tmp_path, args, patterns):
    text = tmp_path / "a.txt"
    text.write_text(prose(1))
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"- {{input: '{text}', txt_delimiter: 're:[a-'}}\n")
    run = tmp_path / "r"
    given = [a.replace("{sources}", str(sources)) for a in args]
    if "--sources" not in given:
        given += ["--input", str(text)]
    invoke(_clean(run, *given), 2, *patterns)
    assert not run.exists()


def test_a_concatenated_code_file_splits_on_a_regex_across_pieces(tmp_path):
    code = tmp_path / "linux-train.txt"
    preamble = "# a corpus of the kernel's C files, one after the other\n\n"
    code.write_text(preamble + c_files(12, SPDX))
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        f"- {{input: '{code}', preset: code, txt_delimiter: 're:^// SPDX-License-Identifier'}}\n"
    )
    run = tmp_path / "r"
    # pieces of about 500 bytes: most cut a C file in two, each still read once
    invoke(_clean(run, "--sources", str(sources), "--set=data.clean.chunk_bytes=500"), 0)
    stats = clean_stats(run)
    assert stats["units"] > 3
    (row,) = stats["sources"]
    assert (row["docs_in"], row["docs_kept"], row["bytes_in"]) == (13, 13, code.stat().st_size)
    texts = sorted(r["text"] for r in kept_rows(run))
    assert texts[0].startswith("# a corpus")
    assert all(t.startswith(SPDX) for t in texts[1:])  # the header line stays with its file
    assert sorted(t.split("\n")[1] for t in texts[1:]) == sorted(
        f"/* file_{i}.c: helpers of part {i} */" for i in range(12)
    )


def test_a_file_failing_with_an_exception_without_a_message_is_named_with_its_type(
    tmp_path, monkeypatch
):
    from codex.pipeline.clean import unit

    src = tmp_path / "in"
    src.mkdir()
    (src / "good.txt").write_text(prose(1))
    (src / "bad.txt").write_text(prose(2))
    real = unit.read_records

    def reader(piece, cfg, report):
        if piece.path.endswith("bad.txt"):
            raise EOFError  # str() is ""
        return real(piece, cfg, report)

    monkeypatch.setattr(unit, "read_records", reader)
    run = tmp_path / "r"
    invoke(
        _clean(run, "--input", str(src), "--workers", "1"),
        1,
        "1 input file(s) failed",
        f"{src / 'bad.txt'}: EOFError  (CODEX_DEBUG=1",  # its type, and no empty ": " after it
    )
