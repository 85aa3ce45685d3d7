"""codex data shard / verify / upload: round trip, determinism, resume after SIGKILL, GCS, bad
input."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from codex.core import fsio
from codex.pipeline.encode import split_long_text
from codex.pipeline.readers import parquet as parquet_mod
from codex.pipeline.shard import encode as encode_mod
from codex.pipeline.shard import write as write_mod
from codex.pipeline.shard.shard import run_shard
from codex.pipeline.shard.verify import verify_shards
from codex.pipeline.upload import upload_run
from tests.fixtures.shard import (  # noqa: F401
    WORDS,
    Stopped,
    make_cfg,
    make_docs,
    make_run,
    npy_sha,
    reference_shards,
    write_clean,
    write_tokenizer,
)

ROOT = Path(__file__).resolve().parents[3]


def expected_split(docs: list[str], val_fraction: float) -> dict:
    out = {"train": [], "val": []}
    for d in docs:
        h = int.from_bytes(hashlib.blake2b(d.encode(), digest_size=8).digest(), "big") / 2**64
        out["val" if h < val_fraction else "train"].append(d)
    return out


def load_split(shards_dir: Path, manifest: dict, split: str, fmt: str = "npy") -> np.ndarray:
    arrays = []
    for e in manifest["shards"]:
        if e["split"] == split and e["format"] == fmt:
            p = shards_dir / e["path"]
            arrays.append(
                np.load(p, mmap_mode="r") if fmt == "npy" else pq.read_table(p).column(0).to_numpy()
            )
    return np.concatenate(arrays)


def decode_docs(tokens: np.ndarray, tok, bos: int = 0, eos: int | None = None) -> list[str]:
    starts = np.flatnonzero(tokens == bos)
    assert starts[0] == 0, "a split starts with <|bos|>"
    docs = []
    for a, b in zip(starts, list(starts[1:]) + [len(tokens)], strict=True):
        ids = tokens[a + 1 : b].tolist()
        if eos is not None:
            assert ids[-1] == eos
            ids = ids[:-1]
        docs.append(tok.decode(ids, skip_special_tokens=False))
    return docs


def shas(manifest: dict) -> list[tuple]:
    return [(e["path"], e["sha256"], e["tokens"], e["documents"]) for e in manifest["shards"]]


# --- round trip and the manifest contract ---------------------------------------------------------


def test_round_trip_manifest_and_verify(tmp_path, corpus, tokenizer_files):
    from codex.pipeline.tokenizer.tokenizer import load_tokenizer

    run = make_run(tmp_path, corpus, tokenizer_files)
    m = run_shard(make_cfg(run))
    out = run / "shards"
    tok = load_tokenizer(str(run / "tokenizer"))
    want = expected_split(corpus, 0.2)
    assert len(want["val"]) > 0 and len(want["train"]) > 0
    for split in ("train", "val"):
        tokens = load_split(out, m, split)
        assert tokens.dtype == np.uint16
        assert decode_docs(tokens, tok) == want[split]
        assert not np.any(tokens == 2), "never a padding token"
        assert m["totals"][split]["documents"] == len(want[split])
        assert m["totals"][split]["tokens"] == len(tokens)
        sizes = [e["tokens"] for e in m["shards"] if e["split"] == split]
        assert all(s == 1500 for s in sizes[:-1]) and 0 < sizes[-1] <= 1500
    assert m["format_version"] == 1 and m["dtype"] == "uint16"
    assert (
        m["tokenizer"]["sha256"]
        == json.loads((run / "tokenizer/tokenizer_meta.json").read_text())["sha256"]
    )
    assert m["special_ids"] == {"bos": 0, "eos": 1, "pad": 2}
    assert all("/" not in e["path"] for e in m["shards"])
    for e in m["shards"]:
        assert hashlib.sha256((out / e["path"]).read_bytes()).hexdigest() == e["sha256"]
    assert (out / "config.yaml").exists()
    assert verify_shards(str(out), str(run / "tokenizer")) == []
    # the training loader accepts the manifest as written
    from codex.train.data.token_shards import (
        load_manifest,
    )

    assert load_manifest(str(out))["totals"] == m["totals"]


def test_append_eos_and_parquet_format(tmp_path, corpus, tokenizer_files):
    from codex.pipeline.tokenizer.tokenizer import load_tokenizer

    run = make_run(tmp_path, corpus, tokenizer_files)
    m = run_shard(make_cfg(run, append_eos=True, format="both"))
    out = run / "shards"
    tok = load_tokenizer(str(run / "tokenizer"))
    want = expected_split(corpus, 0.2)
    for split in ("train", "val"):
        npy, par = load_split(out, m, split, "npy"), load_split(out, m, split, "parquet")
        assert np.array_equal(npy, par)
        assert decode_docs(npy, tok, eos=1) == want[split]
    assert {e["format"] for e in m["shards"]} == {"npy", "parquet"}
    assert verify_shards(str(out)) == []


def test_uint32_shards_hold_the_same_tokens(tmp_path, corpus, tokenizer_files):
    run = make_run(tmp_path, corpus, tokenizer_files)
    m16 = run_shard(make_cfg(run, out=str(tmp_path / "u16")))
    m32 = run_shard(make_cfg(run, out=str(tmp_path / "u32"), dtype="uint32"))
    assert m32["dtype"] == "uint32"
    for split in ("train", "val"):
        a, b = load_split(tmp_path / "u16", m16, split), load_split(tmp_path / "u32", m32, split)
        assert b.dtype == np.uint32 and np.array_equal(a, b)
    assert verify_shards(str(tmp_path / "u32")) == []


def test_split_long_text_pieces():
    text = ("abc def\n" * 400) + ("y" * 3000) + (" z" * 900)
    pieces = split_long_text(text, 1000)
    assert "".join(pieces) == text
    assert all(0 < len(p) <= 1000 for p in pieces)
    assert pieces[0].endswith("\n")  # cut after a newline where there is one
    assert any(p.startswith(" z") for p in pieces)  # else before a space
    assert split_long_text("short", 1000) == ["short"]


# --- determinism and resume -----------------------------------------------------------------------


def test_same_shards_for_any_workers_and_the_reference_layout(
    tmp_path, corpus, tokenizer_files, monkeypatch
):
    run = make_run(tmp_path, corpus, tokenizer_files, files=5)
    S = 700
    one = run_shard(make_cfg(run, out=str(tmp_path / "w1"), shard_tokens=S))
    assert parquet_mod._last_group == []  # the stage's reads keep no row group after it
    monkeypatch.setattr(write_mod, "WRITE_TASK_TOKENS", 3 * S)  # several write tasks
    tasks: list[int] = []  # shards per write task
    run_units = write_mod.run_units

    def spy(fn, units, where, *args):
        if fn is write_mod.shard_write_unit:
            tasks.extend(t.stop - t.first for t in units)
        return run_units(fn, units, where, *args)

    monkeypatch.setattr(write_mod, "run_units", spy)
    two = run_shard(make_cfg(run, out=str(tmp_path / "w2"), shard_tokens=S, workers=2))
    assert two == one and len(one["shards"]) >= 10
    # at most WRITE_TASK_TOKENS a task, and UNITS_PER_WORKER tasks a worker where the shards allow
    assert sum(tasks) == len(one["shards"]) and max(tasks) <= 3
    assert len(tasks) >= min(len(one["shards"]), encode_mod.UNITS_PER_WORKER * 2)
    for e in one["shards"]:
        w1, w2 = tmp_path / "w1" / e["path"], tmp_path / "w2" / e["path"]
        assert w1.read_bytes() == w2.read_bytes()
    # the layout is each split's token stream in corpus order, cut every S tokens
    ref, bounds = reference_shards(run, corpus, make_cfg(run, shard_tokens=S), files=5)
    for split in ("train", "val"):
        entries = [e for e in one["shards"] if e["split"] == split]
        assert [e["path"] for e in entries] == [
            f"{split}_{k:05d}.npy" for k in range(len(ref[split]))
        ]
        for e, tokens in zip(entries, ref[split], strict=True):
            assert e["sha256"] == npy_sha(tokens) and e["tokens"] == len(tokens)
            assert e["documents"] == int(np.count_nonzero(tokens == 0))
    # ... and shards span the parts: a part ends inside a shard
    assert len(bounds) == 5 and any(b % S for b in bounds[:-1])
    for out in ("w1", "w2"):
        assert not (tmp_path / out / ".units").exists()
        assert verify_shards(str(tmp_path / out)) == []
    # complete: nothing redone, same manifest
    again = run_shard(make_cfg(run, out=str(tmp_path / "w1"), shard_tokens=S))
    assert again == one


def counting(monkeypatch) -> dict[str, list[str]]:
    """Record the parts the stage encodes and the shard files it writes (workers=1: in this
    process)."""
    seen: dict[str, list[str]] = {"parts": [], "shards": []}
    encode, write = encode_mod.shard_encode_unit, write_mod.write_npy

    def encode_unit(u):
        seen["parts"].append(os.path.basename(u.path))
        return encode(u)

    def write_npy(path, tokens):
        seen["shards"].append(os.path.basename(path))
        return write(path, tokens)

    monkeypatch.setattr(encode_mod, "shard_encode_unit", encode_unit)
    monkeypatch.setattr(write_mod, "write_npy", write_npy)
    return seen


def test_interrupted_encode_redoes_only_the_missing_parts(
    tmp_path, corpus, tokenizer_files, monkeypatch
):
    run = make_run(tmp_path, corpus, tokenizer_files, files=5)
    ref = run_shard(make_cfg(run, out=str(tmp_path / "ref"), shard_tokens=700))
    parts = sorted(p.name for p in (run / "clean").glob("part-*.parquet"))
    encode = encode_mod.shard_encode_unit

    def dies_at_the_third(u):
        if u.path.endswith(parts[2]):
            raise Stopped  # the driver is stopped
        return encode(u)

    monkeypatch.setattr(encode_mod, "shard_encode_unit", dies_at_the_third)
    cfg = make_cfg(run, shard_tokens=700)
    with pytest.raises(Stopped):
        run_shard(cfg)
    out = run / "shards"
    assert not (out / "manifest.json").exists()
    assert len(list((out / ".units").glob("*/done.json"))) == 2
    assert not list(out.glob("*.npy"))

    monkeypatch.undo()
    seen = counting(monkeypatch)
    assert run_shard(cfg) == ref
    assert seen["parts"] == parts[2:]  # the first two were kept
    assert sorted(seen["shards"]) == sorted(e["path"] for e in ref["shards"])
    assert not (out / ".units").exists() and verify_shards(str(out)) == []


KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
from codex.pipeline.shard import encode, shard, write
from tests.fixtures.shard import make_cfg
after, where = int(sys.argv[2]), sys.argv[3]
count = [0]
def killer(orig):
    def wrapped(*args):
        res = orig(*args)
        count[0] += 1
        if count[0] == after:
            os.kill(os.getpid(), signal.SIGKILL)
        return res
    return wrapped
if where == "encode":  # after a part's marker
    encode.shard_encode_unit = killer(encode.shard_encode_unit)
else:  # a shard's file written, not yet its marker
    write.write_npy = killer(write.write_npy)
shard.run_shard(make_cfg(sys.argv[1], shard_tokens=700))
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["encode", "write"])
def test_sigkill_mid_run_then_rerun_gives_same_manifest(
    tmp_path, corpus, tokenizer_files, where, monkeypatch
):
    run = make_run(tmp_path, corpus, tokenizer_files, files=5)
    ref = run_shard(make_cfg(run, out=str(tmp_path / "ref"), shard_tokens=700))
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT.format(root=str(ROOT)), str(run), "3", where],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    out = run / "shards"
    assert not (out / "manifest.json").exists()
    assert len(list((out / ".units").glob("*/done.json"))) == (3 if where == "encode" else 5)
    marked = len(list((out / ".units" / "shards").glob("*.json")))
    assert marked == (0 if where == "encode" else 2)

    seen = counting(monkeypatch)
    again = run_shard(make_cfg(run, shard_tokens=700))
    assert again == ref
    assert len(seen["parts"]) == (2 if where == "encode" else 0)
    # finished shards were skipped, the one written without its marker is redone
    assert len(seen["shards"]) == len(ref["shards"]) - marked
    assert not [p for p in os.listdir(out) if ".tmp" in p] and not (out / ".units").exists()
    assert verify_shards(str(out)) == []


def test_a_dead_attempts_leftovers_are_removed(tmp_path, corpus, tokenizer_files, monkeypatch):
    run = make_run(tmp_path, corpus, tokenizer_files)
    ref = run_shard(make_cfg(run, out=str(tmp_path / "ref")))
    units = []
    encode = encode_mod.shard_encode_unit

    def first_only(u):
        units.append(u)
        if len(units) > 1:
            raise Stopped
        return encode(u)

    monkeypatch.setattr(encode_mod, "shard_encode_unit", first_only)
    with pytest.raises(Stopped):
        run_shard(make_cfg(run))
    monkeypatch.undo()
    # what a worker killed while writing the second part leaves: a partial file under a final name
    # (an object store's finished upload), a temp file, a marker of another attempt
    u = units[1]
    folder = Path(u.folder)
    folder.mkdir(parents=True)
    (folder / "train.tokens").write_bytes(b"\x01\x02partial")
    (folder / ".tmp-val.tokens.0123abcd").write_bytes(b"partial")
    (folder / "done.json").write_text(json.dumps({"fingerprint": "another run"}))
    out = run / "shards"
    (out / ".tmp-train_00000.npy.deadbeef").write_bytes(b"partial")
    # the unit retried (as Ray retries a task whose worker died)
    marker = encode_mod.shard_encode_unit(u)
    names = ["done.json", "train.lens", "train.tokens", "val.lens", "val.tokens"]
    assert sorted(os.listdir(folder)) == names
    assert (folder / "train.tokens").stat().st_size == 2 * marker["tokens"]["train"]
    assert (folder / "val.lens").stat().st_size == 8 * marker["documents"]["val"]

    seen = counting(monkeypatch)
    assert run_shard(make_cfg(run)) == ref
    assert len(seen["parts"]) == 1  # the third; the first two have their markers
    assert not [p for p in out.rglob("*") if ".tmp" in p.name] and not (out / ".units").exists()
    assert verify_shards(str(out)) == []


def test_corrupt_shard_is_caught_and_redone(tmp_path, corpus, tokenizer_files):
    run = make_run(tmp_path, corpus, tokenizer_files)
    m = run_shard(make_cfg(run))
    out = run / "shards"
    victim = out / m["shards"][1]["path"]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    problems = verify_shards(str(out))
    assert problems and all(victim.name in p for p in problems) and "sha256" in problems[0]
    (out / m["shards"][2]["path"]).write_bytes(victim.read_bytes()[:200])  # truncated
    assert len(verify_shards(str(out))) >= 2
    assert run_shard(make_cfg(run)) == m
    assert verify_shards(str(out)) == []
    stray = out / "train_09999.npy"  # shard-named but not in the manifest
    stray.write_bytes(victim.read_bytes())
    (out / "notes.txt").write_text("not a shard name: not reported")
    problems = verify_shards(str(out))
    assert (
        len(problems) == 1 and "train_09999.npy" in problems[0] and "does not list" in problems[0]
    )


def test_transient_write_errors_are_retried(tmp_path, corpus, tokenizer_files, monkeypatch):
    run = make_run(tmp_path, corpus, tokenizer_files)
    ref = run_shard(make_cfg(run, out=str(tmp_path / "ref")))
    failures = {"left": 2}
    real = fsio.atomic_open

    def flaky(path, mode="wb"):
        if path.endswith(".npy") and failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("connection reset by peer")
        return real(path, mode)

    monkeypatch.setattr(fsio, "atomic_open", flaky)
    monkeypatch.setattr(fsio.time, "sleep", lambda s: None)
    assert shas(run_shard(make_cfg(run, out=str(tmp_path / "flaky")))) == shas(ref)
    assert failures["left"] == 0


# --- bad input ------------------------------------------------------------------------------------


# --- GCS (emulator) -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.gcs
def test_gcs_write_upload_verify_and_corruption(tmp_path, corpus, tokenizer_files, gcs_bucket):
    run = make_run(tmp_path, corpus, tokenizer_files)
    local = run_shard(make_cfg(run))
    remote_out = f"{gcs_bucket}/direct/shards"
    direct = run_shard(make_cfg(run, out=remote_out))  # write straight to gs://
    assert shas(direct) == shas(local)
    assert verify_shards(remote_out) == []

    # an interrupted upload: 3 files in, then the connection dies; a temp object is left behind
    real_upload, calls = fsio.upload, {"n": 0}

    def dying_upload(src, dst):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("killed")
        real_upload(src, dst)

    remote_run = f"{gcs_bucket}/copy"
    fsio.write_bytes(f"{remote_run}/shards/train_00000.npy.tmp-0123abcd", b"partial")
    fsio.upload, saved = dying_upload, fsio.upload
    try:
        with pytest.raises(RuntimeError, match="killed"):
            upload_run(str(run), remote_run)
    finally:
        fsio.upload = saved
    assert not fsio.exists(f"{remote_run}/shards/manifest.json"), "markers go last"
    res = upload_run(str(run), remote_run)
    assert (
        res["skipped"] == 3 and res["uploaded"] == res["files"] - 3 and res["checksum"] == ["md5"]
    )
    assert not fsio.exists(f"{remote_run}/shards/train_00000.npy.tmp-0123abcd")
    assert verify_shards(f"{remote_run}/shards") == []

    # corrupt one object in the bucket: verify names it, a re-upload repairs it
    victim = f"{remote_run}/shards/{local['shards'][0]['path']}"
    data = bytearray(fsio.read_bytes(victim))
    data[-1] ^= 0xFF
    fs, p = fsio.filesystem(victim)
    fs.pipe(p, bytes(data))
    fs.invalidate_cache()
    problems = verify_shards(f"{remote_run}/shards")
    assert (
        problems
        and all(local["shards"][0]["path"] in p for p in problems)
        and "sha256" in problems[0]
    )
    res = upload_run(str(run), remote_run)
    assert res["uploaded"] == 1
    assert verify_shards(f"{remote_run}/shards") == []


# --- the command line -----------------------------------------------------------------------------


def test_cli_shard_verify_upload(tmp_path, corpus, tokenizer_files):
    from click.testing import CliRunner

    from codex.cli.main import cli

    run = make_run(tmp_path, corpus, tokenizer_files)
    out = tmp_path / "elsewhere"
    r = CliRunner().invoke(
        cli,
        [
            "data",
            "shard",
            "--run",
            str(run),
            "--out",
            str(out),
            "--shard-tokens",
            "3000",
            "--val-fraction",
            "0.25",
            "--format",
            "both",
            "--workers",
            "1",
            "--set",
            "data.shard.chunk_chars=1000",
        ],
    )
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert (
        m["shard_tokens"] == 3000
        and m["val_fraction"] == 0.25
        and {e["format"] for e in m["shards"]} == {"npy", "parquet"}
    )
    assert CliRunner().invoke(cli, ["data", "verify", str(run), "--out", str(out)]).exit_code == 0
    (out / m["shards"][0]["path"]).write_bytes(b"garbage")
    r = CliRunner().invoke(cli, ["data", "verify", str(run), "--out", str(out)])
    assert r.exit_code == 1 and m["shards"][0]["path"] in r.output
    r = CliRunner().invoke(cli, ["data", "shard", "--run", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "codex data tokenize" in r.output
    r = CliRunner().invoke(cli, ["data", "upload", str(run), str(tmp_path / "copy")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "copy" / "clean" / "stats.json").read_bytes() == (
        run / "clean" / "stats.json"
    ).read_bytes()


@pytest.mark.slow
@pytest.mark.gcs
def test_upload_refuses_a_target_that_holds_another_run(
    tmp_path, corpus, tokenizer_files, gcs_bucket
):
    from click.testing import CliRunner

    from codex.cli.main import cli

    run_a = make_run(tmp_path / "a", corpus, tokenizer_files)
    run_shard(make_cfg(run_a))
    run_b = make_run(tmp_path / "b", corpus[: len(corpus) // 2], tokenizer_files)
    run_shard(make_cfg(run_b))
    target = f"{gcs_bucket}/run"
    upload_run(str(run_a), target)
    fsio.write_bytes(f"{target}/checkpoints/step_00000010/DONE", b"{}")  # A trained there
    res = CliRunner().invoke(cli, ["data", "upload", str(run_b), target])
    assert res.exit_code == 2 and "holds another run" in res.output and "--overwrite" in res.output
    assert "its clean/stats.json differs" in res.output
    assert fsio.exists(f"{target}/checkpoints/step_00000010/DONE")  # nothing touched
    # the same run again is a resume, not another run
    assert upload_run(str(run_a), target)["uploaded"] == 0
    res = CliRunner().invoke(cli, ["data", "upload", str(run_b), target, "--overwrite"])
    assert res.exit_code == 0, res.output
    assert not fsio.exists(f"{target}/checkpoints/step_00000010/DONE")  # A's files are gone
    assert (
        fsio.read_bytes(f"{target}/shards/manifest.json")
        == (Path(run_b) / "shards" / "manifest.json").read_bytes()
    )
