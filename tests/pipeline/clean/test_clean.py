"""codex data clean: each filter keeps/drops with a reason, bad inputs, resume after SIGKILL,
1 vs 2 workers, exact dedup across tasks, gs:// round trip."""

from __future__ import annotations

import gzip
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codex.core import fsio
from codex.core.config.data import CleanConfig
from codex.pipeline.clean import filters as F
from codex.pipeline.clean import words as W
from codex.pipeline.clean.clean import run_clean
from codex.pipeline.clean.finalize import CleanError
from codex.pipeline.inputs import clean_parts
from tests.fixtures.clean import PROSE, cfg_for, make_corpus, prose, read_out, snapshot  # noqa: F401

ROOT = Path(__file__).resolve().parents[3]


CODE = '''import os


def walk(root):
    """Yield every file below root."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            yield os.path.join(dirpath, name)


class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k=1):
        self.n += k
        return self.n
'''


# ---------------------------------------------------------------------------------------------
# filters: one kept and one dropped document each, with the reason


def check(name: str, text: str, **settings):
    cfg = CleanConfig()
    for k, v in settings.items():
        setattr(getattr(cfg, name), k, v)
    return F.apply_filters(F.Doc(text), cfg, [name])


def test_normalize():
    text, nuls = F.normalize("  Cafe\u0301\r\nline\x00two\x07\rend\t \n")
    assert text == "Caf\u00e9\nlinetwo\nend" and nuls == 1


def test_length_filter():
    assert check("length", "hello world") is None
    assert check("length", "") == "length:empty"
    assert check("length", "x" * 11, max_chars=10) == "length:too_long"
    assert check("length", "abc", min_chars=5) == "length:too_short"


def test_gopher_quality_filter():
    assert check("gopher_quality", PROSE) is None
    assert check("gopher_quality", "The cat and the dog.") == "gopher_quality:short_doc"
    hashes = " ".join(f"#tag{i} the and" for i in range(60))
    assert check("gopher_quality", hashes) == "gopher_quality:too_many_hashes"
    no_stop = " ".join(["apple banana cherry orange"] * 20)
    assert check("gopher_quality", no_stop) == "gopher_quality:not_enough_stop_words"


def test_gopher_repetition_filter():
    assert check("gopher_repetition", PROSE) is None
    repeated = "\n".join(["buy cheap watches online now"] * 10 + [PROSE])
    assert check("gopher_repetition", repeated) == "gopher_repetition:dup_line_frac"


def test_c4_filter():
    doc = F.Doc(PROSE + "\nmenu home contact")  # a line without terminal punctuation is removed
    assert F.c4_filter(doc, CleanConfig().c4) is None and "menu home" not in doc.text
    assert check("c4", PROSE + " function f() { return 1; }.") == "c4:curly_bracket"
    assert check("c4", "Lorem ipsum dolor sit amet. " + PROSE) == "c4:lorem_ipsum"
    assert check("c4", "Only one sentence here.") == "c4:too_few_sentences"


def test_fineweb_filter():
    assert check("fineweb", PROSE) is None
    listing = "\n".join(f"item {i}" for i in range(40))
    assert check("fineweb", listing) == "fineweb:line_punct_ratio"
    short = "\n".join(f"Item {i}." for i in range(40))
    assert check("fineweb", short) == "fineweb:short_line_ratio"


def test_code_filter():
    assert check("code", CODE) is None
    assert check("code", CODE + "x = '" + "a" * 2000 + "'\n") == "code:long_line"
    assert (
        check("code", "0x1f, 0x2e, 0x3d;\n" * 10 + "= = = = = = = = = = = = = = = = = =\n" * 30)
        == "code:low_alnum_fraction"
    )


def test_presets_and_switches():
    c = CleanConfig()
    assert F.active_filters(c) == [
        "length",
        "gopher_quality",
        "gopher_repetition",
        "c4",
        "fineweb",
        "dedup",
    ]
    c.preset = "code"
    assert F.active_filters(c) == ["length", "code", "dedup"]
    assert F.active_filters(c, "trusted") == ["length", "dedup"]  # a source's own preset wins
    c.dedup.enabled = False
    assert F.active_filters(c) == ["length", "code"]


# ---------------------------------------------------------------------------------------------
# end to end


def test_code_preset_keeps_python_and_web_drops_it(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"m{i}.py").write_text(CODE + f"\nVALUE = {i}\n")
    (src / "dup.py").write_text(CODE + "\nVALUE = 0\n")  # exact duplicate of m0.py
    (src / "notes.bin").write_bytes(b"\x00\x01")  # unsupported type inside a dir: skipped
    stats = run_clean(cfg_for(tmp_path, [src], "data.clean.preset=code", run="code"))
    assert (stats["docs_in"], stats["docs_out"]) == (6, 5)
    assert stats["drops"] == {"dedup": {"duplicate": 1}}
    assert stats["files"]["skipped_unsupported"] == 1
    rows = read_out(str(tmp_path / "code"))
    assert sorted(r["text"] for r in rows) == sorted(
        (CODE + f"\nVALUE = {i}\n").strip() for i in range(5)
    )
    assert all(r["source"].endswith(".py") and r["id"] for r in rows)
    # a clean that keeps nothing fails
    with pytest.raises(CleanError, match="kept no documents .*--preset code"):
        run_clean(cfg_for(tmp_path, [src], "data.clean.preset=web", run="web"))
    web = json.loads((tmp_path / "web" / "clean" / "stats.json").read_text())
    assert web["docs_out"] == 0 and web["drops_total"] == 6


def test_formats_and_output_layout(tmp_path):
    (tmp_path / "a.txt").write_text(f"{prose(1)}\n\n===\n\n{prose(2)}")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        for i in range(3, 6):
            f.write(json.dumps({"body": prose(i)}) + "\n")
    import zstandard

    (tmp_path / "c.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(
            "".join(json.dumps({"body": prose(i)}) + "\n" for i in range(6, 8)).encode()
        )
    )
    pq.write_table(pa.table({"content": [prose(8), prose(9)]}), tmp_path / "d.parquet")
    cfg = cfg_for(
        tmp_path,
        [tmp_path / "a.txt", str(tmp_path / "*.jsonl.*"), tmp_path / "d.parquet"],
        "data.clean.txt_delimiter='===\\n'",
        "data.clean.text_field=body",
        "data.clean.text_column=content",
        "data.clean.row_group_size=2",
        "data.clean.docs_per_shard=3",
    )
    stats = run_clean(cfg)
    assert stats["docs_in"] == 9 and stats["docs_out"] == 9, stats
    out = tmp_path / "run" / "clean"
    shards = sorted(out.glob("part-*.parquet"))
    assert len(shards) == 3  # 9 docs, 3 per shard
    meta = pq.ParquetFile(shards[0]).metadata
    assert (
        meta.num_rows == 3
        and meta.num_row_groups == 2
        and meta.row_group(0).column(0).compression == "ZSTD"
    )
    assert sorted(r["text"] for r in read_out(str(tmp_path / "run"))) == sorted(
        prose(i) for i in range(1, 10)
    )
    assert (
        json.loads((out / "stats.json").read_text())["docs_out"] == 9
        and (out / "config.yaml").exists()
    )


def test_keep_rejected_writes_reason(tmp_path):
    (tmp_path / "in.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in [prose(1), "too short.", prose(1)])
    )
    run_clean(cfg_for(tmp_path, [tmp_path / "in.jsonl"], "data.clean.keep_rejected=true"))
    rej = pq.read_table(
        next((tmp_path / "run" / "clean" / "rejected").glob("*.parquet"))
    ).to_pylist()
    assert sorted(r["reason"] for r in rej) == ["dedup:duplicate", "gopher_quality:short_doc"]
    assert {r["text"] for r in rej} >= {prose(1)}


# ---------------------------------------------------------------------------------------------
# bad input: reported, counted, never fatal for the rest


def test_bad_inputs_are_reported_and_the_rest_is_cleaned(tmp_path, caplog):
    d = tmp_path / "in"
    d.mkdir()
    (d / "good.txt").write_text(prose(1))
    (d / "latin1.txt").write_bytes(prose(2).encode() + b" caf\xe9 \xff.")  # invalid UTF-8
    (d / "nul.txt").write_bytes(prose(3).encode().replace(b"valley", b"val\x00ley") + b"\x00")
    (d / "empty.txt").write_bytes(b"")
    lines = [
        json.dumps({"text": prose(4)}),
        "{not json",
        json.dumps({"title": "x"}),
        json.dumps({"text": prose(5)}),
        json.dumps({"text": 3}),
    ]
    (d / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    # cannot be read
    (d / "corrupt.jsonl.gz").write_bytes(gzip.compress(b'{"text": "abc"}\n' * 1000)[:60])
    pq.write_table(pa.table({"body": ["x"], "url": ["u"]}), d / "nocol.parquet")
    cfg = cfg_for(tmp_path, [d])
    with pytest.raises(
        CleanError, match="nocol.parquet: no column 'text' \\(columns: body, url\\)"
    ):
        run_clean(cfg)
    stats = json.loads((tmp_path / "run" / "clean" / "stats.json").read_text())
    bad = stats["bad_input"]
    failed = {Path(f["path"]).name: f["error"] for f in bad["failed_files"]}
    assert set(failed) == {"nocol.parquet", "corrupt.jsonl.gz"}
    assert bad["invalid_utf8_records"]["count"] == 1 and bad["invalid_utf8_records"]["first_files"][
        0
    ].endswith("latin1.txt")
    assert bad["nul_chars"]["count"] == 2
    assert bad["empty_files"]["files"] == 1
    assert bad["malformed_lines"]["count"] == 3
    assert bad["malformed_lines"]["first"][0]["lines"][:2] == [
        "line 2: invalid JSON (Expecting property name enclosed in double quotes, column 2)",
        "line 3: no field 'text' (fields: title)",
    ]
    texts = {r["text"] for r in read_out(str(tmp_path / "run"))}
    assert prose(1) in texts and prose(3) in texts and prose(4) in texts and prose(5) in texts
    assert any(t.startswith(prose(2)) and "\ufffd" in t for t in texts)
    assert "nocol.parquet" in caplog.text and "invalid UTF-8" in caplog.text
    # a rerun redoes only what failed (the chunk holding the failed files) and still reports it
    (d / "nocol.parquet").unlink()
    (d / "corrupt.jsonl.gz").unlink()
    # the input set changed: refuse to mix outputs
    with pytest.raises(Exception, match="other inputs"):
        run_clean(cfg)


def test_huge_single_line_is_dropped_with_bounded_memory(tmp_path):
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.write(json.dumps({"text": prose(1)}).encode() + b"\n")
        f.write(b'{"text": "')
        for _ in range(200):  # a single 200 MB line, written in
            f.write(b"a" * (1 << 20))  # pieces, never held by this test
        f.write(b'"}\n')
        f.write(json.dumps({"text": prose(2)}).encode() + b"\n")
    code = (
        "import resource, json; from codex.core.config import build_config; "
        "from codex.pipeline.clean.clean import run_clean\n"
        f"cfg = build_config(run={str(tmp_path / 'run')!r}); "
        f"cfg.data.clean.inputs = [{str(big)!r}]; cfg.data.clean.allow_low_yield = True\n"
        "s = run_clean(cfg)\n"
        # VmHWM is this process's own peak: ru_maxrss carries the parent's peak across fork+exec
        "hwm = int(next(l for l in open('/proc/self/status') "
        "if l.startswith('VmHWM')).split()[1])\n"
        "print(json.dumps([s['docs_out'], s['drops'], hwm]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    docs_out, drops, maxrss_kb = json.loads(out.stdout.strip().splitlines()[-1])
    assert docs_out == 2 and drops == {"length": {"too_long": 1}}
    assert maxrss_kb < 150_000, maxrss_kb  # never held the 200 MB line


# ---------------------------------------------------------------------------------------------
# scale: workers, tasks, resume


def test_one_and_two_workers_give_identical_output(tmp_path):
    make_corpus(tmp_path / "in", 6, 30)
    # parts packed by about 3 units
    args = ["data.clean.chunk_bytes=20000", "data.clean.part_bytes=12000"]
    s1 = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="w1"))
    s2 = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, "data.clean.workers=2", run="w2"))
    assert s1["units"] > 2 and s1["dedup_across_units"] > 0
    assert (
        snapshot(tmp_path / "w1") == snapshot(tmp_path / "w2")
        and len(snapshot(tmp_path / "w1")) > 2
    )
    assert s1 == s2


def test_without_the_compiled_counter_clean_warns_and_gives_the_same_output(
    tmp_path, monkeypatch, caplog
):
    """Where the package was installed without a C compiler, clean says so and counts words in
    Python: the same parts and stats (web and code filters over prose and source code)."""
    make_corpus(tmp_path / "in", 2, 30)
    (tmp_path / "in" / "code.jsonl").write_text(
        "".join(json.dumps({"text": Path(m.__file__).read_text()}) + "\n" for m in (F, json))
    )
    compiled = run_clean(cfg_for(tmp_path, [tmp_path / "in"], run="compiled"))
    monkeypatch.setattr(W, "COUNTER", None)
    with caplog.at_level(logging.WARNING):
        python = run_clean(cfg_for(tmp_path, [tmp_path / "in"], run="python"))
    assert "the compiled word counter (pipeline/clean/_wordcount.c) is not built" in caplog.text
    assert snapshot(tmp_path / "python") == snapshot(tmp_path / "compiled")
    assert python == compiled and python["docs_out"] > 0


def test_dedup_is_exact_across_tasks(tmp_path):
    make_corpus(tmp_path / "in", 4, 30)
    small = "data.clean.chunk_bytes=20000"
    single = run_clean(cfg_for(tmp_path, [tmp_path / "in"], small, run="one"))
    ran = []
    for i in (1, 0):  # any order; the last task to finish writes stats.json
        stats = run_clean(
            cfg_for(
                tmp_path,
                [tmp_path / "in"],
                small,
                "data.clean.num_tasks=2",
                f"data.clean.task_index={i}",
                run="two",
            )
        )
        ran.append(stats["units_run"])
    texts = [r["text"] for r in read_out(str(tmp_path / "two"))]
    assert len(texts) == len(set(texts)) == single["docs_out"] == stats["docs_out"]
    assert stats["drops"]["dedup"] == single["drops"]["dedup"]
    # one plan whoever runs it: the two tasks split the units and give the single run's bytes
    assert all(ran) and sum(ran) == single["units_run"] == single["units"] > 2
    assert snapshot(tmp_path / "one") == snapshot(tmp_path / "two")


@pytest.mark.slow
def test_sigkill_midway_then_rerun_matches_uninterrupted(tmp_path):
    make_corpus(tmp_path / "in", 24, 400)
    args = ["data.clean.chunk_bytes=100000"]
    ref = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="ref"))
    assert ref["units"] >= 12
    code = (
        "from codex.core.config import build_config\n"
        "from codex.pipeline.clean.clean import run_clean\n"
        f"cfg = build_config(overrides={args!r}, run={str(tmp_path / 'killed')!r})\n"
        f"cfg.data.clean.inputs = [{str(tmp_path / 'in')!r}]\nrun_clean(cfg)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.DEVNULL, start_new_session=True
    )
    markers = tmp_path / "killed" / "clean" / "markers"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(markers.glob("*.json"))) < 3:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done_before = len(list(markers.glob("*.json")))
    assert 3 <= done_before < ref["units"], "the run finished before it could be killed"
    assert not (tmp_path / "killed" / "clean" / "stats.json").exists()
    again = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="killed"))
    # the rerun does only the units without a marker
    assert again.pop("units_run") == ref.pop("units_run") - done_before
    assert again == ref
    assert snapshot(tmp_path / "killed") == snapshot(tmp_path / "ref")
    assert not list((tmp_path / "killed" / "clean").glob(".tmp-*"))
    # a rerun of a finished run changes nothing
    assert run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="killed")) == {
        **ref,
        "units_run": 0,
    }
    assert snapshot(tmp_path / "killed") == snapshot(tmp_path / "ref")


@pytest.mark.gcs
def test_gcs_round_trip(tmp_path, gcs_bucket):
    make_corpus(tmp_path / "in", 3, 10)
    for p in sorted((tmp_path / "in").iterdir()):
        fsio.upload(str(p), f"{gcs_bucket}/raw/{p.name}")
    local = run_clean(cfg_for(tmp_path, [tmp_path / "in"], run="local"))
    remote = run_clean(cfg_for(tmp_path, [f"{gcs_bucket}/raw"], run=f"{gcs_bucket}/run"))
    assert remote["docs_out"] == local["docs_out"] > 0 and remote["drops"] == local["drops"]
    assert sorted(r["text"] for r in read_out(f"{gcs_bucket}/run")) == sorted(
        r["text"] for r in read_out(str(tmp_path / "local"))
    )
    assert all(r["source"].startswith("gs://") for r in read_out(f"{gcs_bucket}/run"))
    assert fsio.read_json(f"{gcs_bucket}/run/clean/stats.json")["docs_out"] == local["docs_out"]


@pytest.mark.gcs
def test_on_gcs_unit_names_are_spread_and_a_unit_asks_nothing_before_it_writes(
    tmp_path, gcs_bucket, monkeypatch
):
    """On gs:// a unit's part, marker and hash file names start with a hash of the unit
    (fsio.spread: GCS spreads load by name ranges), a local run's names are as they were, and a
    unit's only requests for its outputs are their uploads: no listing, no existence check,
    no deletion of what a first attempt cannot have left."""
    from codex.core.gcs import BoundedGCSFileSystem
    from codex.pipeline.clean import clean as C

    make_corpus(tmp_path / "in", 3, 10)
    for p in sorted((tmp_path / "in").iterdir()):
        fsio.upload(str(p), f"{gcs_bucket}/raw/{p.name}")
    asked: list[tuple[str, str]] = []
    in_unit = []
    request = BoundedGCSFileSystem._request

    async def counted(self, method, path, *args, **kwargs):
        if in_unit:
            asked.append((method, self._format_path(path, args) + str(kwargs.get("prefix", ""))))
        return await request(self, method, path, *args, **kwargs)

    def unit(job):
        in_unit.append(1)
        try:
            return clean_unit(job)
        finally:
            in_unit.clear()

    clean_unit = C.clean_unit
    monkeypatch.setattr(BoundedGCSFileSystem, "_request", counted)
    monkeypatch.setattr(C, "clean_unit", unit)
    local = run_clean(cfg_for(tmp_path, [tmp_path / "in"], run="local"))
    remote = run_clean(cfg_for(tmp_path, [f"{gcs_bucket}/raw"], run=f"{gcs_bucket}/run"))
    assert all(n.startswith("part-000") for n in local["shards"]), local["shards"]
    spread = fsio.spread(f"{gcs_bucket}/run", "000000")
    assert remote["shards"][0].startswith(f"part-{spread}") and spread != "000000"
    assert fsio.exists(f"{gcs_bucket}/run/clean/markers/{spread}.json")
    outputs = [(m, u) for m, u in asked if "raw" not in u]  # not its input
    assert outputs and all(m == "POST" for m, _ in outputs), outputs


def test_a_low_yield_clean_exits_1_and_downstream_refuses_it_until_allowed(tmp_path, caplog):
    """The user's report: WikiText's blank lines hold a space, so '\\n\\n' never matched, the
    whole file was one document dropped as too long, and clean kept 0.02% with exit 0."""
    src = tmp_path / "in"
    src.mkdir()
    paragraphs = [prose(k).replace("\n", " ") for k in range(2500)]  # 1.4 MB: over max_chars
    (src / "wiki.txt").write_text(" \n".join(f" {p} \n" for p in paragraphs))  # ' \n \n'
    (src / "small.txt").write_text(prose(999))
    cfg = cfg_for(tmp_path, [src], "data.clean.txt_delimiter=\\n\\n", run="r")
    with caplog.at_level("WARNING", logger="codex.clean"), pytest.raises(CleanError) as e:
        run_clean(cfg)
    msg = str(e.value)
    assert "kept 0." in msg and "length:too_long" in msg and "--allow-low-yield" in msg
    # the dropped file is named, with the switch that keeps it
    warned = [r.getMessage() for r in caplog.records if "dropped whole" in r.getMessage()]
    assert len(warned) == 1 and "wiki.txt" in warned[0] and "blank-lines" in warned[0]
    starved = [
        r.getMessage() for r in caplog.records if "under 1% of their bytes" in r.getMessage()
    ]
    assert len(starved) == 1 and "wiki.txt (0.0%)" in starved[0]
    stats = json.loads((tmp_path / "r" / "clean" / "stats.json").read_text())
    assert stats["bad_input"]["whole_files_dropped"][0]["path"].endswith("wiki.txt")
    with pytest.raises(ValueError, match="allow-low-yield"):
        clean_parts(str(tmp_path / "r"))
    # allowed: the same units, no re-cleaning, and the corpus is usable
    cfg.data.clean.allow_low_yield = True
    again = run_clean(cfg)
    assert again["units_run"] == 0 and "low_yield" not in again
    assert len(clean_parts(str(tmp_path / "r"))) == 1
    # the fix the message names: blank-lines splits it into its paragraphs
    fixed = run_clean(cfg_for(tmp_path, [src], "data.clean.txt_delimiter=blank-lines", run="f"))
    assert fixed["docs_out"] == 2501 and fixed["bytes_out"] > 0.9 * fixed["bytes_in"]


def test_a_rerun_removes_the_temp_files_of_a_killed_run(tmp_path):
    make_corpus(tmp_path / "in", 2, 10)
    cfg = cfg_for(tmp_path, [tmp_path / "in"], run="r")
    run_clean(cfg)
    clean = tmp_path / "r" / "clean"
    left = [clean / ".tmp-stats.json.k1x2", clean / "hashes" / ".tmp-000000.npy.a8f3"]
    left += [clean / "dedup" / ".tmp-drops-0000.npy.zz", clean / ".tmp-part-000000-000.parquet.q"]
    for p in left:
        p.write_bytes(b"partial")
    run_clean(cfg)
    assert not [p for p in left if p.exists()]


def test_sources_carry_their_own_preset_and_delimiter(tmp_path):
    """Code and prose in one run: the .py files under the code rules, a blank-line-delimited text
    file under the web rules, by `codex data clean --sources FILE`."""
    from click.testing import CliRunner

    from codex.cli.main import cli

    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        body = [f"    value_{j} = x * {j} + {i}  # step {j}" for j in range(12)]
        (src / f"mod{i}.py").write_text("\n".join([f"def f{i}(x):", *body, "    return value_0\n"]))
    paragraphs = [prose(k).replace("\n", " ") for k in range(30)]
    (tmp_path / "wiki.txt").write_text(" \n".join(f" {p} \n" for p in paragraphs))
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        f"- {{input: '{src}/*.py', preset: code}}\n"
        f"- {{input: '{tmp_path / 'wiki.txt'}', txt_delimiter: blank-lines}}\n"
    )
    run = tmp_path / "run"
    res = CliRunner().invoke(cli, ["data", "clean", "--run", str(run), "--sources", str(sources)])
    assert res.exit_code == 0, res.output
    kept = read_out(str(run))
    assert sum(r["source"].endswith(".py") for r in kept) == 6
    assert sum(r["source"].endswith("wiki.txt") for r in kept) == 30
    # stats.json reports each input file
    per_file = {
        Path(e["path"]).name: e
        for e in json.loads((run / "clean" / "stats.json").read_text())["per_file"]
    }
    assert (
        len(per_file) == 7
        and per_file["wiki.txt"]["docs_in"] == per_file["wiki.txt"]["docs_kept"] == 30
    )
    assert per_file["mod0.py"]["docs_kept"] == 1 and per_file["mod0.py"]["bytes_kept"] > 400
    # the same inputs under one preset and no delimiter keep neither kind whole
    res = CliRunner().invoke(
        cli,
        ["data", "clean", "--run", str(tmp_path / "one"), "--input", str(src)]
        + ["--input", str(tmp_path / "wiki.txt")],
    )
    one = read_out(str(tmp_path / "one"))
    assert sum(r["source"].endswith(".py") for r in one) < 6
    assert sum(r["source"].endswith("wiki.txt") for r in one) < 30
    # a source with a key it does not know is a usage error naming it
    sources.write_text(f"- {{input: '{src}', presets: code}}\n")
    res = CliRunner().invoke(
        cli, ["data", "clean", "--run", str(tmp_path / "x"), "--sources", str(sources)]
    )
    assert res.exit_code == 2 and "data.clean.sources[0]: unknown key 'presets'" in res.output


def _texts(seed: int, n: int) -> list[str]:
    """Random Unicode (white space of several kinds, punctuation, numerals such as '²' and '五',
    combining marks, a lone surrogate) and the symbols and words _WORD has rules for, mixed."""
    import random

    rng = random.Random(seed)
    pool = [chr(c) for c in range(0x20, 0x3000)] + list(W.PUNCTUATION)
    pool += list(" \n\t\u00a0\u2003\x1c") * 20 + list("abc def.,'-_:/") * 30
    pool += ["²", "½", "五", "Ⅻ", "１", "％", "\u0301", "\U0001f600", "\ud800"]
    rules = ["://", "http", "e.g.", "U.S.", "Inc.", "Dr.", "a.", "..", "...", "--", "---",
             "''", "'s", "’ll", "'re", "n't", "/or", "+1", "1-2", "3.5", "1,000", "a_b", "__",
             "…", "—", "C++", "(x)", "foo(", "self.x,", "-f", "=", "==", "#", "a@b.org", "the",
             "and", "don't", "cannot", "Can't", "10am", "GPL-2+", "x.org", "me@x.org",
             "foo-bar.deb", "foo—bar.deb", "a–b.org", "https://a.io/b", "(howto.html),", ":-)",
             "a.m.", "gonna"]  # fmt: skip
    texts = []
    for _ in range(n):
        parts = [rng.choice(rules) if rng.random() < 0.3 else rng.choice(pool)]
        parts += [rng.choice(rules) if rng.random() < 0.3 else rng.choice(pool)
                  for _ in range(rng.randint(0, 120))]  # fmt: skip
        texts.append("".join(parts))
    return texts


def _words(text: str) -> list[str]:
    """The words by their definition: each piece's _piece_words with _WORD itself."""
    return [w for piece in text.split() for w in W._piece_words(piece, W._WORD.findall)]


@pytest.mark.parametrize("counter", ["compiled", "python"])
def test_word_split_and_gopher_counters_equal_their_per_word_definitions(monkeypatch, counter):
    """split_words (the pieces' words found once, by _WORD_FAST and spaCy's tables for the
    pieces they change) gives _words (_WORD and the tables piece by piece), and
    word_counts gives Gopher's counts by their per-word definitions, on random and adversarial
    text and on source code; also while the piece cache is forgotten between documents, and
    when counts learnt a piece before a split needs its words. word_counts both ways: compiled
    (pipeline/clean/_wordcount.c) and in Python (_Pieces.counts: pieces of letters and digits
    counted by C loops, the others' rows summed in numpy)."""
    import sysconfig

    if counter == "python":
        monkeypatch.setattr(W, "COUNTER", None)
    elif W.COUNTER is None:
        pytest.skip("the compiled word counter is not built (no C compiler at install)")
    else:  # its cache forgotten as often as the Python one's below
        monkeypatch.setattr(W.COUNTER, "cache_size", 300)
    W.forget_pieces()
    texts = _texts(0, 1500)
    texts.append(Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text())
    texts += ["", " \n ", "x", "the and", "(" * 50, "é" * 20 + " 12 ²½ 五", "(１) １, a１ ％１"]
    # many new pieces in one document (their words counted in numpy, not one by one)
    texts.append(" ".join([f"(w{i}," for i in range(30)] + ["(the", "and,", "of)", "[１]", "be:"]))
    monkeypatch.setattr(W, "_PIECE_CACHE", 300)  # forgotten many times over these texts

    def definition(text):
        words = _words(text)
        real = [w for w in words if w[0].isalnum() or any(c not in W.PUNCTUATION for c in w)]
        alpha = sum(any(c.isalpha() for c in w) for w in words)
        stop = len(W.STOP_WORDS.intersection(words))
        return (len(words), len(real), sum(map(len, real)), alpha, stop)

    for text in texts:
        assert W.split_words(text) == _words(text), repr(text)
        assert W.word_counts(text) == definition(text), repr(text)
    # a special case of letters and digits ("cannot") in a document whose count forgets the cache
    # (or grows its table): counted from its own words, not a row the cache no longer holds
    monkeypatch.setattr(W, "_PIECE_CACHE", 2)
    if W.COUNTER is not None:
        monkeypatch.setattr(W.COUNTER, "cache_size", 2)
    W.forget_pieces()
    for text in ["a, b, c, d,", "cannot", "cannot Cannot", " ".join(f"x{i}," for i in range(5000))]:
        for doc in (text, "cannot 10am " + text, text + " cannot gonna,"):
            assert W.word_counts(doc) == definition(doc), doc[:40]
    # counts learn pieces without their words: a split after them finds the words then
    W.forget_pieces()
    for text in texts[:300]:
        W.word_counts(text)
        assert W.split_words(text) == _words(text), repr(text)
    # _WORD_FAST is _WORD, piece by piece, in both modes (re.ASCII on ASCII pieces only)
    for text in texts[:300]:
        for piece in text.split():
            fast = W._WORD_FAST_ASCII if piece.isascii() else W._WORD_FAST
            assert fast.findall(piece) == W._WORD.findall(piece), repr(piece)


def test_ascii_words_equal_the_regex():
    """ascii_words (pipeline/clean/_wordcount.c: _WORD_FAST_ASCII's alternatives written out in
    C, which the compiled counter and split_words use on ASCII pieces) gives the regex's words:
    on every pair of ASCII characters, every triple of the characters the rules name, and random
    strings of the rules' fragments (white space included: it is the regex's findall, not only
    a piece's). A str that is not ASCII is refused."""
    import itertools
    import random

    try:
        from codex.pipeline.clean._wordcount import ascii_words
    except ImportError:
        pytest.skip("the compiled word counter is not built (no C compiler at install)")
    rng = random.Random(5)
    every = [chr(c) for c in range(128)]
    named = list("aZq9_ .,'-:/+*^()!?\"=<>`{}[]@#&;~|\\$%\t\x00\x1c")
    fragments = ["://", "http", "e.g.", "U.S.", "Inc.", "Co.", "Corp.", "Sep.", "Sept.", "a.",
                 "..", "...", "--", "---", "''", "'s", "'S", "'ll", "'re", "'ve", "'m", "n't",
                 "/or", "/orb", "+1", "1-2", "2-", "1^2", "3*-4", "3.5", "1,000", "a_b", "__",
                 "C++", "(x)", "foo(", "self.x,", "-f", "==", "a@b.org", "don't", "10am",
                 "GPL-2+", "x.org", "https://a.io/b?q=1).", "(howto.html),", ":-)", "a.m.",
                 "a--b", "a---b", "a:b", "a,b", ".)", "!?)", "x=-1", "#!/usr/bin"]  # fmt: skip
    texts = [a + b for a in every for b in every]
    texts += map("".join, itertools.product(named, repeat=3))
    for _ in range(30_000):
        pool = rng.choice([every, named, fragments])
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(0, 20))))
    texts += ["".join(rng.choice(fragments + named) for _ in range(2000))]
    for text in texts:
        assert ascii_words(text) == W._WORD_FAST_ASCII.findall(text), repr(text)
    with pytest.raises(ValueError, match="needs an ASCII str"):
        ascii_words("café")
    # and words.py uses it: the C was written for this pattern (an edited pattern needs the C and
    # its PATTERN_SHA256 updated; words.py falls back to the regex engine meanwhile)
    assert W._ascii_words is ascii_words


@pytest.mark.skipif(sys.version_info < (3, 11), reason="possessive repeats came in Python 3.11")
def test_url_piece_takes_the_prefix_symbols_whole():
    """_URL_PIECE's (?=(X*))\\1 (a form Python 3.10 compiles) matches as the possessive X*+ it
    stands for: the same groups on pieces with URLs between symbols and on random pieces (where
    a greedy X* differs: "(:@b.org" is no URL piece)."""
    import re

    prefix = f"(?=([{W._AFFIX}]*))\\1"
    assert W._URL_PIECE.pattern.startswith(prefix)
    possessive = re.compile(W._URL_PIECE.pattern.replace(prefix, f"([{W._AFFIX}]*+)", 1))
    # "@b.org" after "(" or "(:": a greedy prefix would give the symbols back as the URL's user
    urls = ["a@b.org", "x.org/a=b", "foo-bar.deb", "https://a.io/b?q=1", "@b.org", "(a.b)"]
    pieces = [p + u + s for p in ["", "(", "((", '"', "<", "(:", "@("] for u in urls
              for s in ["", ")", ").", ",", "))"]]  # fmt: skip
    pieces += [p for t in _texts(4, 400) for p in t.split()]
    matched = 0
    for piece in pieces:
        a, b = W._URL_PIECE.fullmatch(piece), possessive.fullmatch(piece)
        assert (a and a.groups()) == (b and b.groups()), repr(piece)
        matched += a is not None
    assert matched >= 30


def _dup_ngram_chars(words: list[str], n: int) -> int:
    """datatrove's find_all_duplicate: characters in n-grams seen before, a Python step each."""
    seen, chars, i = set(), 0, 0
    while i < len(words) - n + 1:
        gram = tuple(words[i : i + n])
        if gram in seen:
            chars, i = chars + sum(map(len, gram)), i + n
        else:
            seen.add(gram)
            i += 1
    return chars


def _reference_repetition(text: str, words: list[str], cfg) -> str | None:
    """The Gopher repetition filter as written before the numpy n-grams: a Python step per line,
    paragraph and n-gram (datatrove's find_top_duplicate and find_all_duplicate, tuple keys)."""
    import re
    from collections import Counter

    def duplicates(items):
        seen, n, chars = set(), 0, 0
        for x in items:
            if x in seen:
                n, chars = n + 1, chars + len(x)
            else:
                seen.add(x)
        return n, chars

    paragraphs = re.split(r"\n{2,}", text)
    n, chars = duplicates(paragraphs)
    if cfg.dup_para_frac and n / len(paragraphs) > cfg.dup_para_frac:
        return "dup_para_frac"
    if cfg.dup_para_char_frac and chars / len(text) > cfg.dup_para_char_frac:
        return "dup_para_char_frac"
    lines = [line for line in text.split("\n") if line]
    n, chars = duplicates(lines)
    if cfg.dup_line_frac and n / len(lines) > cfg.dup_line_frac:
        return "dup_line_frac"
    if cfg.dup_line_char_frac and chars / len(text) > cfg.dup_line_char_frac:
        return "dup_line_char_frac"
    for n, frac in zip((2, 3, 4), cfg.top_ngram_fracs, strict=False):
        if frac and len(words) >= n:
            grams_ = Counter(zip(*(words[i:] for i in range(n)), strict=False))
            gram, count = grams_.most_common(1)[0]
            if (sum(map(len, gram)) + n - 1) * count / len(text) > frac:
                return f"top_{n}_gram"
    for n, frac in zip(range(5, 11), cfg.dup_ngram_fracs, strict=False):
        if frac and len(words) >= n and _dup_ngram_chars(words, n) / len(text) > frac:
            return f"duplicated_{n}_grams"
    return None


@pytest.mark.slow
def test_ngrams_equal_a_python_reference():
    """NGrams (n-gram ids by one stable sort a level; the walk of find_all_duplicate through
    the repeated positions only) gives what a Python step per n-gram gives: the most frequent
    n-gram's characters and count (the first to occur among equals), and the characters in
    repeated n-grams (the jumps kept), exactly, on random word sequences from small and large
    vocabularies, on runs and overlapping repeats, and on unicode words; and the repetition
    filter's decisions equal the reference's under several thresholds."""
    import dataclasses
    import random
    from collections import Counter

    rng = random.Random(1)
    seqs = [[], ["a"], ["a"] * 40, ["ab", "a", "b"] * 7, list("abcabcabd" * 5)]
    seqs += [list("aaaaabaaaaabaaaaa"), ["é", "五", "😀", "x"] * 9 + ["é"]]
    for _ in range(400):
        vocab = [rng.choice(["a", "bb", "ccc", "é", "五六", "the"]) + str(i)
                 for i in range(rng.choice([1, 2, 3, 5, 50]))]  # fmt: skip
        seq = [rng.choice(vocab) for _ in range(rng.randint(0, 300))]
        if seq and rng.random() < 0.5:  # a block repeated, overlapping itself
            k = rng.randint(0, len(seq) - 1)
            seq[k:k] = seq[k : k + rng.randint(1, 12)] * rng.randint(1, 4)
        seqs.append(seq)
    for words in seqs:
        grams = F.NGrams(words)
        for n in range(2, 11):
            if len(words) < n:
                break
            grams.extend()
            counter = Counter(zip(*(words[i:] for i in range(n)), strict=False))
            gram, count = counter.most_common(1)[0]
            assert grams.top() == (sum(map(len, gram)) + n - 1, count), (words, n)
            assert grams.duplicated_chars() == _dup_ngram_chars(words, n), (words, n)
    base = CleanConfig().gopher_repetition
    cfgs = [base, dataclasses.replace(base, dup_para_frac=0, dup_para_char_frac=0,
                                      dup_line_frac=0, dup_line_char_frac=0)]  # fmt: skip
    cfgs += [dataclasses.replace(cfgs[1], top_ngram_fracs=[0.5] * 3, dup_ngram_fracs=[f] * 6)
             for f in (0.02, 0.1, 0.3)]  # fmt: skip
    docs = [" ".join(w) for w in seqs if w] + [t for t in _texts(2, 300) if t.strip()]
    docs += ["\n".join(["buy cheap watches online now"] * 10 + [PROSE]), PROSE]
    reasons = Counter()
    for text in docs:
        for cfg in cfgs:
            got = F.gopher_repetition_filter(F.Doc(text), cfg)
            assert got == _reference_repetition(text, _words(text), cfg), text
            reasons[got] += 1
    assert len(reasons) >= 6, reasons  # the thresholds decide, not one rule every time


@pytest.mark.slow
def test_compiled_counter_errors_keep_no_half_learnt_piece():
    """A regex error while the compiled counter learns a document's new pieces raises it, and
    the pieces met in that document are forgotten: the next count is still the right one. A
    callback that counts with its own Counter is refused (its rows may move meanwhile). The
    memory of a huge document's rows and of a huge piece's word spans is given back."""
    if W.COUNTER is None:
        pytest.skip("the compiled word counter is not built (no C compiler at install)")
    from codex.pipeline.clean._wordcount import Counter

    def findall(piece):
        if piece == "boom!":
            raise RuntimeError("regex failed")
        return W._WORD_FAST.findall(piece)

    settings = {**W.counter_settings(), "findall_ascii": findall, "findall": findall}
    settings["cache_size"] = 100
    counter = Counter(**settings)
    with pytest.raises(RuntimeError, match="regex failed"):
        counter.counts("the (cat), sat; boom!")
    assert len(counter) == 0
    text = "the (cat), sat; on the mat."
    assert counter.counts(text) == W._Pieces().counts(text)
    with pytest.raises(TypeError, match="needs a str"):
        counter.counts(b"bytes")  # type: ignore[arg-type]

    def counts_again(piece):  # a callback that uses its own Counter is refused, not obeyed
        return [str(counter.counts("x"))]

    counter.__init__(**{**settings, "findall_ascii": counts_again, "findall": counts_again})
    with pytest.raises(RuntimeError, match="cannot be used from its own callbacks"):
        counter.counts("(x)")
    assert counter.counts("abc def") == (2, 2, 6, 2, 0)  # letters and digits: no callback
    with pytest.raises(RuntimeError, match="__init__ was not called"):
        Counter.__new__(Counter).counts("x")
    assert len(Counter.__new__(Counter)) == 0
    # a failed __init__ leaves it unusable, not half set up with the old tables
    with pytest.raises(TypeError):
        counter.__init__(**{**settings, "stop_bits": {"the": 1, "and": "x"}})
    with pytest.raises(RuntimeError, match="__init__ was not called"):
        counter.counts("the and")
    # the rows of a huge document are given back when the pieces are forgotten
    import tracemalloc

    counter.__init__(**settings)
    huge = " ".join(f"({i})" for i in range(100_000))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        counter.counts(huge)  # rows for 100,000 pieces: 40 bytes each
        counter.counts("x")  # over cache_size: forgotten first
        assert tracemalloc.get_traced_memory()[0] - before < 1_000_000
        # and the word spans of one huge ASCII piece (400,000 words), found by ascii_words in C
        compiled = Counter(**{**W.counter_settings(), "cache_size": 100})
        before = tracemalloc.get_traced_memory()[0]
        assert compiled.counts("a," * 200_000) == W._Pieces().counts("a," * 200_000)
        assert tracemalloc.get_traced_memory()[0] - before < 1_000_000  # the piece: 400 KB
    finally:
        tracemalloc.stop()


def test_line_counts_and_normalize_equal_their_definitions():
    """Gopher's bullet and end-ellipsis lines counted by the regex engine (and line by line where
    another line break than "\n" occurs), and normalize's bytes.translate test for control
    characters in ASCII text, equal the plain definitions."""
    texts = _texts(3, 400) + ["- a\n  - b\n\n...\nx…  \n• y", "a...\n", "\u2028- x...", ""]
    texts += ["\t-a\x0b- b\x1f\n\x1f• c ...\t", "....\n......  \n. . ."]
    for text in texts:
        lines = text.splitlines()
        expected = (
            len(lines),
            sum(s.lstrip().startswith(("•", "-")) for s in lines),
            sum(s.rstrip().endswith(("...", "…")) for s in lines),
        )
        assert F._line_counts(F.Doc(text)) == expected, repr(text)
    for text in ["plain ascii\ttext\n", "bell\x07 del\x7f nul\x00\r\n", "é\x85 \x9f x\x00"]:
        expected = F._CONTROL.sub("", text.replace("\r\n", "\n")).strip()
        assert F.normalize(text) == (expected, text.count("\x00"))


def test_part_columns_equal_pyarrows_own():
    """PartWriter's columns, put together from their buffers (pyarrow's constructors import
    pandas), are the arrays pyarrow makes itself."""
    from codex.pipeline.clean.parts import string_array

    for values in [[], [""], ["a", "", "héllo wörld", "\U0001f600" * 3, "x" * 5000], list("abc")]:
        got = string_array(values)
        got.validate(full=True)
        assert got.equals(pa.array(values, pa.string())), values


@pytest.mark.parametrize("lost", ["part", "hashes"])
def test_a_marker_whose_files_are_gone_is_cleaned_again(tmp_path, lost, caplog):
    """A unit's part (or hash file) deleted while its marker stays, after a finished clean: the
    rerun names the unit, cleans it again, and the output equals an undisturbed run's."""
    make_corpus(tmp_path / "in", 4, 30)
    small = ["data.clean.chunk_bytes=20000", "data.clean.part_bytes=0"]  # each unit's own parts
    whole = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *small, run="whole"))
    run_clean(cfg_for(tmp_path, [tmp_path / "in"], *small, run="hurt"))
    clean = tmp_path / "hurt" / "clean"
    gone = sorted(clean.glob("part-*.parquet"))[1]
    unit = gone.name.split("-")[1]
    if lost == "hashes":
        gone = clean / "hashes" / f"{unit}.npy"
    gone.unlink()
    with caplog.at_level(logging.WARNING):
        again = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *small, run="hurt"))
    assert f"unit {unit}'s marker lists" in caplog.text and "cleaning the unit again" in caplog.text
    assert again["units_run"] == 1
    assert snapshot(tmp_path / "hurt") == snapshot(tmp_path / "whole")
    for k in ("docs_out", "drops", "units"):
        assert again[k] == whole[k]


def test_a_retried_unit_removes_its_marker_before_its_files(tmp_path):
    """A retry of a unit (a Ray task after its worker died) that is interrupted after removing the
    old files must not leave the old marker vouching for them: the marker goes first."""
    from codex.pipeline.clean import unit as U

    make_corpus(tmp_path / "in", 2, 30)
    run_clean(cfg_for(tmp_path, [tmp_path / "in"], run="r"))
    out = str(tmp_path / "r" / "clean")
    (marker,) = (tmp_path / "r" / "clean" / "markers").glob("*.json")
    U.remove_unit_outputs(U.marker_files(out, json.loads(marker.read_text())))
    assert not marker.exists() and not list((tmp_path / "r" / "clean").glob("part-*"))


def outputs(run: Path) -> dict[str, bytes]:
    """Every file a clean leaves that later stages or a rerun read: parts, rejected rows, hash
    files (not markers, stats.json or dedup/: those record who ran what, and when)."""
    clean = run / "clean"
    files = [*clean.glob("part-*"), *clean.glob("rejected/*"), *clean.glob("hashes/*")]
    return {str(p.relative_to(clean)): p.read_bytes() for p in sorted(files)}


class Interrupted(BaseException):
    """The process stopping at an injected point (a kill, as far as the files can tell)."""


INTERRUPTED_ARGS = ["data.clean.chunk_bytes=20000", "data.clean.keep_rejected=true"]


def interrupt_a_unit(tmp_path, monkeypatch, where: str) -> dict:
    """An undisturbed run (RUN ref), and a run (RUN hurt) with one unit interrupted `where`: after
    writing its files and before its marker, or, retried, after removing its marker and before
    its files. Checks that the unit's files are left without a marker; returns ref's stats."""
    from codex.pipeline.clean import unit as U

    make_corpus(tmp_path / "in", 4, 30)
    args = INTERRUPTED_ARGS
    ref = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="ref"))
    assert ref["units"] >= 3
    clean = tmp_path / "hurt" / "clean"
    unit = "000001"
    write_json, rm, read_records = fsio.write_json, fsio.rm, U.read_records
    if where == "after_removing_the_marker":
        # the unit's first attempt fails on one of its files: its marker says so, and the next
        # run cleans it again (a retry)
        def failing(piece, c, report):  # after its first 10 records: the unit has parts
            for i, rec in enumerate(read_records(piece, c, report)):
                if i == 10 and piece.path.endswith("f001.jsonl"):
                    raise PermissionError(f"{piece.path}: injected")
                yield rec

        monkeypatch.setattr(U, "read_records", failing)
        with pytest.raises(CleanError, match="injected"):
            run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="hurt"))
        monkeypatch.setattr(U, "read_records", read_records)
        unit = min(
            p.stem for p in clean.glob("markers/*.json") if json.loads(p.read_text())["failed"]
        )

        def stop_after_the_marker(path, recursive=False):
            if f"part-{unit}-" in path:  # the marker is gone: its files are next
                raise Interrupted
            rm(path, recursive)

        monkeypatch.setattr(fsio, "rm", stop_after_the_marker)
    else:

        def stop_before_the_marker(path, obj):
            if path.endswith(f"markers/{unit}.json"):
                raise Interrupted
            write_json(path, obj)

        monkeypatch.setattr(fsio, "write_json", stop_before_the_marker)
    with pytest.raises(Interrupted):
        run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="hurt"))
    monkeypatch.setattr(fsio, "rm", rm)
    monkeypatch.setattr(fsio, "write_json", write_json)
    # its files are there, its marker is not
    assert not (clean / "markers" / f"{unit}.json").exists()
    assert list(clean.glob(f"part-{unit}-*.parquet"))
    assert (clean / "hashes" / f"{unit}.npy").exists()
    return ref


def same_but_units_run(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k != "units_run"} == {
        k: v for k, v in b.items() if k != "units_run"
    }


@pytest.mark.parametrize("where", ["before_the_marker", "after_removing_the_marker"])
def test_an_interrupted_unit_leaves_no_marker_without_its_files_and_a_rerun_matches(
    tmp_path, monkeypatch, where
):
    """A unit interrupted between its files and its marker, either way round: its files are
    left without a marker, never a marker without its files, and a rerun gives the bytes of an
    undisturbed run."""
    ref = interrupt_a_unit(tmp_path, monkeypatch, where)
    again = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *INTERRUPTED_ARGS, run="hurt"))
    assert outputs(tmp_path / "hurt") == outputs(tmp_path / "ref") and outputs(tmp_path / "ref")
    assert same_but_units_run(again, ref) and 0 < again["units_run"] < ref["units"]
    assert not list((tmp_path / "hurt" / "clean").rglob(".tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before_the_marker", "after_removing_the_marker"])
def test_an_interrupted_unit_rerun_on_ray_matches(tmp_path, monkeypatch, where, ray_cluster):
    """The same, with the rerun on a Ray cluster: its workers clean the interrupted unit again
    over the files it left, and give the undisturbed run's bytes."""
    ref = interrupt_a_unit(tmp_path, monkeypatch, where)
    cfg = cfg_for(tmp_path, [tmp_path / "in"], *INTERRUPTED_ARGS, run="hurt")
    cfg.data.executor, cfg.data.ray_address = "ray", ray_cluster
    again = run_clean(cfg)
    assert outputs(tmp_path / "hurt") == outputs(tmp_path / "ref") and outputs(tmp_path / "ref")
    assert same_but_units_run(again, ref) and 0 < again["units_run"] < ref["units"]
    assert not list((tmp_path / "hurt" / "clean").rglob(".tmp-*"))


def rows_in_order(run: Path, stats: dict) -> list[dict]:
    """The cleaned corpus's rows, its parts in stats.json's order."""
    clean = run / "clean"
    return [r for name in stats["shards"] for r in pq.read_table(clean / name).to_pylist()]


def test_parts_are_packed_to_part_bytes_and_a_rerun_resumes(tmp_path, caplog):
    """Consecutive units' parts are packed into parts of about part_bytes: the same rows in the
    same order as the units' own parts. A rerun of the finished run does nothing (it removes
    what an interrupted deletion left); a packed part lost after it cleans its units again and
    gives the same bytes."""
    from codex.pipeline.clean import pack as P

    make_corpus(tmp_path / "in", 8, 30)
    args = ["data.clean.chunk_bytes=20000", "data.clean.row_group_size=7"]
    own = run_clean(
        cfg_for(tmp_path, [tmp_path / "in"], *args, "data.clean.part_bytes=0", run="own")
    )
    own_markers = (tmp_path / "own" / "clean" / "markers").glob("*.json")
    target = int(2.5 * max(json.loads(p.read_text())["part_bytes"] for p in own_markers))
    args.append(f"data.clean.part_bytes={target}")  # 2 or 3 units a part
    packed = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="packed"))
    clean = tmp_path / "packed" / "clean"
    assert packed["packed"] and 1 < len(packed["shards"]) < own["units"] <= len(own["shards"])
    assert rows_in_order(tmp_path / "packed", packed) == rows_in_order(tmp_path / "own", own)
    assert sorted(p.name for p in clean.glob("part-*.parquet")) == sorted(packed["shards"])
    assert clean_parts(str(tmp_path / "packed")) == sorted(str(clean / n) for n in packed["shards"])
    # each packed part holds units until they reach part_bytes (the last one: what is left)
    markers = {p.stem: json.loads(p.read_text()) for p in clean.glob("markers/*.json")}
    groups = P.pack_groups([markers[u] for u in sorted(markers)], target)
    names = [P.packed_name(f"{a:06d}", f"{b - 1:06d}") for a, b in groups if b - a > 1]
    assert names and set(names) <= set(packed["shards"])
    sizes = [sum(markers[f"{u:06d}"]["part_bytes"] for u in range(a, b)) for a, b in groups]
    assert all(size >= target for size in sizes[:-1]), sizes
    # row groups of row_group_size rows across the units' (whose last ones are short)
    meta = max((pq.ParquetFile(clean / n).metadata for n in names), key=lambda m: m.num_rows)
    rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert meta.num_rows > 30 and set(rows[:-1]) == {7}, rows
    before = outputs(tmp_path / "packed")
    # a rerun of the finished run; a unit's part an interrupted deletion left is removed
    (clean / "part-000001-000.parquet").write_bytes(b"left by a killed deletion")
    again = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="packed"))
    assert again == {**packed, "units_run": 0} and outputs(tmp_path / "packed") == before
    # a packed part lost: its units, and every unit packed away, are cleaned again
    (clean / packed["shards"][1]).unlink()
    with caplog.at_level(logging.WARNING):
        redone = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="packed"))
    assert "whose parts were packed with them" in caplog.text
    assert redone["units_run"] > 0 and {**redone, "units_run": 0} == again
    assert outputs(tmp_path / "packed") == before


@pytest.mark.slow
def test_packed_parts_are_the_same_bytes_on_ray(tmp_path, ray_cluster):
    make_corpus(tmp_path / "in", 6, 30)
    args = ["data.clean.chunk_bytes=20000", "data.clean.part_bytes=12000"]
    local = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="local"))
    cfg = cfg_for(tmp_path, [tmp_path / "in"], *args, run="ray")
    cfg.data.executor, cfg.data.ray_address = "ray", ray_cluster
    assert run_clean(cfg) == local and local["packed"]
    assert snapshot(tmp_path / "ray") == snapshot(tmp_path / "local")
    assert len(snapshot(tmp_path / "local")) == len(local["shards"]) < local["units"]
