"""Bad input and misuse: the error policy every stage keeps (docs/bad-input.md).

    exit 1  bad data (a file, line or key named), nothing lost, no completion marker left behind
    exit 2  usage or config (a key and its allowed values named), before any run file is read
    always  one line, never a traceback (CODEX_DEBUG=1 shows it)

Each case runs the real CLI (tests/fixtures/bad_input.py: invoke). Here: the cases across stages
(CODEX_DEBUG, a run that is a file, a missing bucket, a full disk, orphaned ranks); each stage's
own sit beside its tests, in test_*_bad_input.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from codex.cli.main import cli
from tests.fixtures.bad_input import TRAIN, invoke
from tests.fixtures.clean import prose


def test_debug_env_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("CODEX_DEBUG", "1")
    with pytest.raises(Exception, match="train.lr"):
        CliRunner().invoke(cli, ["train", "--set", "train.lr=-1"], catch_exceptions=False)
    assert os.environ["CODEX_DEBUG"] == "1"


@pytest.mark.parametrize("command", [["data", "clean", "--input", "{src}"], ["train", *TRAIN]])
def test_a_run_directory_that_is_a_file_is_named(tmp_path, command):
    src = tmp_path / "a.txt"
    src.write_text(prose(1))
    run = tmp_path / "run"
    run.write_text("not a folder")
    args = [a.replace("{src}", str(src)) for a in command]
    invoke([*args, "--run", str(run)], 2, str(run), "not a directory")
    assert run.read_text() == "not a folder"


@pytest.mark.gcs
def test_a_run_in_a_missing_bucket_names_the_bucket(tmp_path, gcs_emulator):
    text = tmp_path / "a.txt"
    text.write_text(prose(1))
    run = "gs://no-such-bucket-codex/run"
    for args in (
        ["data", "clean", "--input", str(text)],
        ["data", "tokenize"],
        ["eval"],
        ["train", *TRAIN],
    ):
        invoke([*args, "--run", run], 2, "gs://no-such-bucket-codex: no such bucket")


def test_a_full_disk_is_one_line_and_a_rerun_keeps_the_finished_work(tmp_path, monkeypatch):
    import errno

    from codex.core import fsio

    src = tmp_path / "in.txt"
    src.write_text(prose(3))
    real = fsio.write_json

    def full(path, obj, *a, **k):  # the disk fills up as the stage commits
        if str(path).endswith("stats.json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, obj, *a, **k)

    monkeypatch.setattr(fsio, "write_json", full)
    run = tmp_path / "run"
    out = invoke(["data", "clean", "--run", str(run), "--input", str(src)], 1, "stats.json")
    assert "no space left on the device" in out and "MB free on its disk" in out
    assert list((run / "clean" / "markers").glob("*.json"))  # the finished unit is kept
    monkeypatch.setattr(fsio, "write_json", real)
    invoke(["data", "clean", "--run", str(run), "--input", str(src)], 0)
    assert (run / "clean" / "stats.json").exists()


def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_loses_nothing(run, monkeypatch):
    """ENOSPC inside DCP's tensor write (torch.save under it turns it into a RuntimeError, and DCP
    wraps that in a CheckpointException): one line naming the file, exit 1; the last checkpoint
    stays, and a rerun resumes from it."""
    import errno

    from fsspec.implementations.local import LocalFileSystem

    class Full:
        """A file on a disk with no space left: every write fails."""

        def __init__(self, f):
            self.f = f

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    real_open = LocalFileSystem._open

    def full_open(self, path, mode="rb", *args, **kwargs):
        f = real_open(self, path, mode, *args, **kwargs)
        return Full(f) if "step_00000005" in str(path) and "w" in mode else f

    monkeypatch.setattr(LocalFileSystem, "_open", full_open)
    out = invoke(["train", "--run", str(run), *TRAIN, "--max-steps", "5"], 1, "step_00000005")
    assert "no space left on the device" in out and "MB free on its disk" in out
    ckpts = run / "checkpoints"
    assert (ckpts / "step_00000003" / "DONE").exists()
    assert not (ckpts / "step_00000005" / "DONE").exists()
    monkeypatch.undo()
    invoke(["train", "--run", str(run), *TRAIN, "--max-steps", "5"], 0)
    assert (ckpts / "step_00000005" / "DONE").exists()


@pytest.mark.slow
@pytest.mark.parametrize("armed", [True, False])
def test_a_rank_dies_with_its_killed_launcher(tmp_path, armed):
    """A SIGKILL of the torchrun agent alone: a rank that armed die_with_launcher (as every rank
    torchrun starts does) gets SIGTERM and exits instead of training on, holding the run lock;
    the unarmed control shows the kill alone would leave it running."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "rank.pid"
    arm = (
        "from codex.train.distributed.process_env import die_with_launcher; die_with_launcher(); "
        if armed
        else ""
    )
    rank = f"import os, time; {arm}open({str(pid_file)!r}, 'w').write(str(os.getpid()))"
    rank += "; time.sleep(120)"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {rank!r}]).wait()",
        ],
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (pid_file.exists() and pid_file.read_text()):
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    agent.kill()
    agent.wait()

    def running() -> bool:  # not gone, not a zombie
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + (20 if armed else 2)
    while time.time() < deadline and running():
        time.sleep(0.05)
    alive = running()
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert alive is not armed
