"""`codex data clean` on links among its inputs, through the real CLI: a link that leads nowhere
(dangling, a cycle) fails the run naming it, or is skipped and counted with
data.clean.skip_unreadable_links; a link back into the input folder is never followed and no file
is read twice. Policy: docs/bad-input.md, "Links among clean's inputs"."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow.parquet as pq

from tests.fixtures.bad_input import invoke, warnings_with
from tests.fixtures.clean import prose

SKIP = "--set=data.clean.skip_unreadable_links=true"


def _clean(run: Path, *args: str) -> list[str]:
    return ["data", "clean", "--run", str(run), *args]


def _stats(run: Path) -> dict:
    return json.loads((run / "clean" / "stats.json").read_text())


def _sources(run: Path) -> list[str]:
    """The source file of every kept document, sorted."""
    parts = (run / "clean").glob("part-*.parquet")
    return sorted(s for part in parts for s in pq.read_table(part)["source"].to_pylist())


def _corpus_with_bad_links(src: Path) -> list[Path]:
    """Three good text files, a dangling link and a cycle c.txt -> d.txt -> c.txt; returns the
    links."""
    src.mkdir()
    for i in range(3):
        (src / f"good{i}.txt").write_text(prose(i))
    (src / "dangling.txt").symlink_to("nowhere.txt")
    (src / "c.txt").symlink_to("d.txt")
    (src / "d.txt").symlink_to("c.txt")
    return [src / "c.txt", src / "d.txt", src / "dangling.txt"]


def test_dangling_and_cyclic_links_fail_the_run_naming_them_then_a_skip_is_counted(
    tmp_path, caplog
):
    src = tmp_path / "in"
    links = _corpus_with_bad_links(src)
    run = tmp_path / "r"
    invoke(
        _clean(run, "--input", str(src)),
        1,
        "3 input file(s) failed",
        *(str(p) for p in links),
        "a dangling link (to nowhere.txt",
        "a link in a cycle (to d.txt",
        "data.clean.skip_unreadable_links=true",
    )
    stats = _stats(run)
    failed = stats["bad_input"]["failed_files"]
    assert [f["path"] for f in failed] == [str(p) for p in links] and all(f["link"] for f in failed)
    # never an empty document: 3 files read, 3 documents
    assert stats["docs_in"] == 3 and stats["bad_input"]["empty_files"]["count"] == 0
    # the same run, skipping them: only their unit is redone, and they are counted as skipped
    with caplog.at_level(logging.WARNING):
        invoke(_clean(run, "--input", str(src), SKIP), 0)
    stats = _stats(run)
    assert stats["docs_in"] == stats["docs_out"] == 3
    assert stats["bad_input"]["empty_files"]["count"] == 0
    assert stats["bad_input"]["failed_files"] == []
    files = stats["files"]
    assert files["inputs"] == 3 and files["skipped_links"] == 3
    assert [e["path"] for e in files["first_skipped_links"]] == [str(p) for p in links]
    assert "dangling link" in files["first_skipped_links"][2]["why"]
    assert all(str(p) not in r["path"] for p in links for r in stats["per_file"])
    assert warnings_with(caplog, "3 input link(s) not read", str(links[0]))
    assert _sources(run) == [str(src / f"good{i}.txt") for i in range(3)]


def test_with_the_skip_setting_a_fresh_run_skips_the_links(tmp_path):
    src = tmp_path / "in"
    _corpus_with_bad_links(src)
    run = tmp_path / "r"
    invoke(_clean(run, "--input", str(src), SKIP), 0)
    stats = _stats(run)
    assert stats["docs_in"] == 3 and stats["files"]["skipped_links"] == 3


def test_a_named_link_that_leads_nowhere_is_a_usage_error(tmp_path):
    src = tmp_path / "in"
    _corpus_with_bad_links(src)
    for name, why in (("dangling.txt", "a dangling link"), ("c.txt", "a link in a cycle")):
        run = tmp_path / name
        invoke(_clean(run, "--input", str(src / name)), 2, str(src / name), why)
        assert not run.exists()


def test_a_folder_link_loop_is_not_followed_and_no_file_is_read_twice(tmp_path):
    src, outside = tmp_path / "in", tmp_path / "outside"
    (src / "sub").mkdir(parents=True)
    outside.mkdir()
    (src / "a.txt").write_text(prose(1))
    (src / "sub" / "b.txt").write_text(prose(2))
    (outside / "c.txt").write_text(prose(3))
    (src / "sub" / "back").symlink_to("..")  # a folder link into the input folder: a loop
    (src / "loop.txt").symlink_to(src)  # a folder link with a text file's name
    (src / "alias.txt").symlink_to("a.txt")  # a file read under its own name
    (src / "sub" / "up.txt").symlink_to("../sub/b.txt")
    (src / "c-link.txt").symlink_to(outside / "c.txt")  # a file outside: read through its link
    (src / "c-again.txt").symlink_to(outside / "c.txt")
    run = tmp_path / "r"
    invoke(_clean(run, "--input", str(src), "--set=data.clean.dedup.enabled=false"), 0)
    stats = _stats(run)
    assert _sources(run) == [str(src / "a.txt"), str(src / "c-again.txt"), str(src / "sub/b.txt")]
    assert stats["docs_in"] == 3 and stats["files"]["inputs"] == 3
    why = {e["path"]: e["why"] for e in stats["files"]["first_skipped_links"]}
    assert why == {
        str(src / "alias.txt"): f"a link to the file read as {src / 'a.txt'}",
        str(src / "c-link.txt"): f"a link to the file read as {src / 'c-again.txt'}",
        str(src / "loop.txt"): (
            f"a link to a folder (to {src}), not followed: name the folder in --input"
        ),
        str(src / "sub/up.txt"): f"a link to the file read as {src / 'sub/b.txt'}",
    }
    assert stats["files"]["first_skipped"] == [str(src / "sub" / "back")]  # no text file's name
