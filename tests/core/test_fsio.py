"""The I/O layer: atomic writes locally and on GCS (real emulator)."""

import os

import pytest

from codex.core import fsio


def test_atomic_write_leaves_old_file_on_error(tmp_path):
    p = str(tmp_path / "a" / "f.json")
    fsio.write_json(p, {"v": 1})
    with pytest.raises(RuntimeError):
        with fsio.atomic_open(p, "wb") as f:
            f.write(b"partial")
            raise RuntimeError("killed")
    assert fsio.read_json(p) == {"v": 1}
    assert os.listdir(tmp_path / "a") == ["f.json"]  # no temp file left behind


def test_read_json_error_names_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{\n  1,\n}")
    with pytest.raises(ValueError, match=f"{p}: not valid JSON \\(line 2"):
        fsio.read_json(str(p))


def test_listdir_glob_local(tmp_path):
    for n in ("b.txt", "a.txt", "c.bin"):
        (tmp_path / n).write_text(n)
    assert [os.path.basename(x) for x in fsio.glob(str(tmp_path / "*.txt"))] == ["a.txt", "b.txt"]
    assert len(fsio.listdir(str(tmp_path))) == 3
    assert fsio.listdir(str(tmp_path / "missing")) == []


def test_local_answers_are_fsspecs(tmp_path, monkeypatch):
    """fsio answers a local path with os calls (no fsspec import): the same answers fsspec's
    LocalFileSystem gives, for files, folders, links, relative paths and file:// URLs."""
    from fsspec.implementations.local import LocalFileSystem

    fs = LocalFileSystem()
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "f.txt").write_text("four")
    (tmp_path / "d" / ".hidden").write_text("x")
    os.symlink(tmp_path / "d" / "f.txt", tmp_path / "d" / "link")
    monkeypatch.chdir(tmp_path)
    paths = [
        "d",
        "d/f.txt",
        "d/sub",
        "d/link",
        "d/missing",
        str(tmp_path / "d"),
        f"file://{tmp_path}/d",
    ]
    for path in paths:
        p = fs._strip_protocol(path)
        assert fsio.exists(path) == fs.exists(p), path
        assert fsio.isdir(path) == fs.isdir(p), path
        want = sorted(fs.ls(p, detail=False)) if fs.exists(p) else []
        assert fsio.listdir(path) == want, path
        if fs.isfile(p):
            assert fsio.size(path) == fs.size(p), path
            with fsio.open(path, "rb") as f:
                assert f.read() == b"four"
    with pytest.raises(ValueError, match="recursive"):  # as fsspec: a folder only with recursive
        fsio.rm("d/sub")
    fsio.rm("d/link")
    assert (tmp_path / "d" / "f.txt").exists() and not os.path.lexists(tmp_path / "d" / "link")
    fsio.rm("d/missing")  # nothing there: nothing to do
    fsio.rm("d", recursive=True)
    assert not (tmp_path / "d").exists()


def test_a_clean_worker_runs_without_importing_fsspec(tmp_path):
    """What a data stage's pool process does (import the stage, clean a local unit) never imports
    fsspec: it is ~80 ms of every worker's start, which a 2-core run waits for."""
    import subprocess
    import sys

    (tmp_path / "in.jsonl").write_text('{"text": "A few words of prose, enough for a unit."}\n')
    code = f"""
import sys
from codex.core.config import Config
from codex.pipeline.clean.plan import plan_units
from codex.pipeline.clean.unit import UnitJob, clean_unit
from codex.pipeline.readers import InputFile
c = Config().data.clean
f = InputFile({str(tmp_path / "in.jsonl")!r}, {(tmp_path / "in.jsonl").stat().st_size}, "jsonl")
(unit,) = plan_units([f], c)
marker = clean_unit(UnitJob(unit, c, {str(tmp_path / "out")!r}, ["length"], "fp"))
assert marker["docs_in"] == 1, marker
print("fsspec" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.gcs
def test_gcs_round_trip(gcs_bucket, tmp_path):
    url = f"{gcs_bucket}/run/x/f.json"
    fsio.write_json(url, {"a": [1, 2]})
    assert fsio.exists(url)
    assert fsio.read_json(url) == {"a": [1, 2]}
    assert fsio.listdir(f"{gcs_bucket}/run/x") == [url]
    local = tmp_path / "big.bin"
    local.write_bytes(os.urandom(3 << 20))
    fsio.upload(str(local), f"{gcs_bucket}/run/big.bin")
    assert fsio.size(f"{gcs_bucket}/run/big.bin") == 3 << 20
    fsio.download(f"{gcs_bucket}/run/big.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == local.read_bytes()
    # a failed write commits nothing under the final name
    with pytest.raises(RuntimeError):
        with fsio.atomic_open(f"{gcs_bucket}/run/half.bin") as f:
            f.write(b"x" * 100)
            raise RuntimeError("killed")
    assert not fsio.exists(f"{gcs_bucket}/run/half.bin")


@pytest.mark.gcs
def test_gcs_glob_no_match_is_empty(gcs_bucket):
    fsio.write_text(f"{gcs_bucket}/d/a.txt", "a")
    assert fsio.glob(f"{gcs_bucket}/d/*.json") == []
    assert fsio.glob(f"{gcs_bucket}/d/*.txt") == [f"{gcs_bucket}/d/a.txt"]


def test_atomic_write_has_normal_permissions(tmp_path):
    p = tmp_path / "out.json"
    fsio.write_json(str(p), {})
    umask = os.umask(0)
    os.umask(umask)
    assert (p.stat().st_mode & 0o777) == (0o666 & ~umask)


@pytest.mark.gcs
def test_a_rename_on_the_emulator_is_one_move(gcs_bucket, caplog):
    """gcsfs renames with objects.move (a checkpoint's folder, DCP's metadata): the emulator the
    suite runs answers it (tests/fixtures/gcs_emulator.py), so no rename waits ~30 s in gcsfs's
    retries
    of a 501 before falling back to copy + delete."""
    import time

    fs, _ = fsio.filesystem(gcs_bucket)
    fsio.write_text(f"{gcs_bucket}/a/x.tmp", "payload")
    t0 = time.perf_counter()
    with caplog.at_level("WARNING", logger="gcsfs"):
        fs.mv(f"{gcs_bucket}/a/x.tmp", f"{gcs_bucket}/a/x.json")
    assert time.perf_counter() - t0 < 5
    assert "Falling back to copy/delete" not in caplog.text
    fs.invalidate_cache()
    assert fsio.read_text(f"{gcs_bucket}/a/x.json") == "payload"
    assert not fsio.exists(f"{gcs_bucket}/a/x.tmp")


@pytest.mark.gcs
def test_gcs_names_are_listed_without_a_listing_cache_and_deleted_in_batches(gcs_bucket):
    """A folder's names come a page at a time, names only (its sub-folders too); no listing is
    kept in the filesystem's cache (gcsfs would keep every entry for ever); a batch deletion
    leaves nothing, and deleting what is not there is no error."""
    paths = [f"{gcs_bucket}/run/clean/part-{i:03d}.parquet" for i in range(5)]
    for p in paths:
        fsio.write_text(p, "x")
    fsio.write_text(f"{gcs_bucket}/run/clean/markers/000.json", "{}")
    names = fsio.list_names(f"{gcs_bucket}/run/clean")
    assert names == ["markers", *(fsio.basename(p) for p in paths)], names
    assert fsio.list_names(f"{gcs_bucket}/run/none") == []
    fs, _ = fsio.filesystem(paths[0])
    fsio.listdir(f"{gcs_bucket}/run/clean")
    assert not fs.dircache.use_listings_cache and not list(fs.dircache)
    fsio.rm_many([*paths, f"{gcs_bucket}/run/clean/never.parquet"])
    fsio.rm(f"{gcs_bucket}/run/clean/never.parquet")
    assert fsio.list_names(f"{gcs_bucket}/run/clean") == ["markers"]
