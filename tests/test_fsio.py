"""The I/O layer: atomic writes locally and on GCS (real emulator)."""

import os

import pytest

from codex import fsio


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
