"""The run-directory lock (codex/core/runlock.py): one writer per run, local and on gs://.

Cross-process cases run the real CLI in subprocesses and kill the holder with SIGKILL; the lease
logic itself is checked in-process. GCS: the shared emulator (tests/conftest.py) does not honour
ifGenerationMatch (it accepts every conditional write), so the precondition cases run against the
same emulator with a small shim that answers 412 the way GCS does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from codex.core import runlock
from codex.core.runlock import LockHeld, LockLost, RunLock
from tests.fixtures.runs import base_overrides, child_env, make_run
from tests.fixtures.shard import make_docs, write_clean, write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()


def codex_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "codex.cli", *args]


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"{what}: the process exited early ({proc.returncode}): "
                f"{proc.stderr.read()[-3000:]}"
            )
        if time.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def assert_refused(proc: subprocess.CompletedProcess, command: str, pid: int) -> None:
    """Exit 2, one line naming the holder: its command, pid, host and start time."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"is in use by `{command}` (pid {pid} on host {HOST}, since " in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert "Traceback" not in proc.stderr


def sigkill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


# --- the CLI, across processes -------------------------------------------------------------------


@pytest.mark.slow
def test_second_trainer_exits_2_and_a_sigkilled_trainers_lease_is_taken_over(tmp_path):
    run = make_run(tmp_path / "run")
    lease = Path(run) / runlock.LEASE_NAME
    metrics = Path(run) / "metrics.jsonl"
    first = subprocess.Popen(
        codex_cmd("train", "--run", run, *sets(base_overrides(max_steps=100_000))),
        env=child_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: metrics.exists() and metrics.read_text().count("\n") >= 2,
            90,
            "first trainer's steps",
            first,
        )
        held = json.loads(lease.read_text())
        assert (held["pid"], held["host"], held["command"]) == (first.pid, HOST, "codex train")

        second = subprocess.run(
            codex_cmd("train", "--run", run, *sets(base_overrides(max_steps=3))),
            env=child_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert_refused(second, "codex train", first.pid)
        assert first.poll() is None  # the holder is untouched
    finally:
        if first.poll() is None:
            sigkill(first)
    assert json.loads(lease.read_text())["pid"] == first.pid  # SIGKILL leaves the lease behind

    third = subprocess.run(
        codex_cmd("train", "--run", run, *sets(base_overrides(max_steps=3))),
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert third.returncode == 0, third.stderr[-3000:]
    assert "taking over the stale lock" in third.stderr
    assert f"its process {first.pid} is no longer running on this host" in third.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3]  # it trained (from scratch: nothing was saved)
    assert not list(Path(run).glob(".codex-lock*"))  # released on a clean exit, guard file too


# The first shard blocks inside its first shard write, holding the lock, until it is killed.
BLOCKING_SHARD = """
import sys, time
from pathlib import Path
from codex.pipeline.shard import write
def write_npy(path, tokens):
    Path(sys.argv[1]).write_text("writing")
    time.sleep(600)
write.write_npy = write_npy
from codex.cli.main import cli
cli(sys.argv[2:], prog_name="codex")
"""


@pytest.mark.slow
def test_second_shard_exits_2_and_a_sigkilled_shards_lease_is_taken_over(tmp_path):
    run = tmp_path / "run"
    docs = make_docs(60)
    write_clean(run, docs)
    write_tokenizer(run, docs, vocab_size=300)
    args = ["data", "shard", "--run", str(run), "--shard-tokens", "1500", "--val-fraction", "0.2"]
    started = tmp_path / "started"
    first = subprocess.Popen(
        [sys.executable, "-c", BLOCKING_SHARD, str(started), *args],
        env=child_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(started.exists, 60, "first shard's write", first)
        second = subprocess.run(
            codex_cmd(*args), env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert_refused(second, "codex data shard", first.pid)
        assert not (run / "shards" / "manifest.json").exists()
    finally:
        if first.poll() is None:
            sigkill(first)

    third = subprocess.run(
        codex_cmd(*args), env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=90
    )
    assert third.returncode == 0, third.stderr[-3000:]
    assert "taking over the stale lock" in third.stderr
    manifest = json.loads((run / "shards" / "manifest.json").read_text())
    assert manifest["totals"]["train"]["tokens"] > 0
    assert not list(run.glob(".codex-lock*"))


def test_which_commands_take_which_lease(tmp_path):
    """Writers are refused while RUN is held; read-only commands are not; eval's lease is RUN/eval's
    (it runs beside a trainer); a clean job-array task is refused only by the same task."""
    from click.testing import CliRunner

    from codex.cli.main import cli

    run = make_run(tmp_path / "run")
    text = tmp_path / "a.txt"
    text.write_text("some text\n")
    other = make_run(tmp_path / "other")

    def invoke(*args):
        return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False).output

    refused = "is in use by `codex train` (pid"
    with RunLock(run, "codex train"):
        for args in (
            ["data", "clean", "--run", run, "--input", text],
            ["data", "tokenize", "--run", run],
            ["data", "shard", "--run", run],
            ["train", "--run", run],
            ["data", "upload", other, run],
            ["demo", "--run", run],
        ):
            out = invoke(*args)
            assert refused in out, (args, out)
        for args in (["sample", "--run", run, "--prompt", "x"], ["eval", "--run", run]):
            out = invoke(*args)
            # past the lock
            assert "in use" not in out and "no intact checkpoint" in out, (
                args,
                out,
            )
        with RunLock(f"{run}/eval", "codex eval"):
            assert "is in use by `codex eval`" in invoke("eval", "--run", run)
    task = ["data", "clean", "--run", run, "--input", text, "--num-tasks", "2", "--task-index", "1"]
    with RunLock(run, "codex data clean (task 1)", lease_name=".codex-lock.clean-task-00001.json"):
        assert "is in use by `codex data clean (task 1)`" in invoke(*task)


# --- the lease, in-process -----------------------------------------------------------------------


def test_lease_records_the_holder_beats_and_refuses_a_second_writer(tmp_path):
    with RunLock(tmp_path, "codex test", heartbeat=0.05) as lock:
        lease = json.loads(Path(lock.path).read_text())
        assert (lease["host"], lease["pid"], lease["command"]) == (HOST, os.getpid(), "codex test")
        first_beat = lease["heartbeat"]
        wait_for(
            lambda: json.loads(Path(lock.path).read_text())["heartbeat"] > first_beat,
            5,
            "a heartbeat",
        )
        with pytest.raises(LockHeld, match=rf"in use by `codex test` \(pid {os.getpid()} on host "):
            RunLock(tmp_path, "codex other").acquire()
        # the refusal changed nothing
        assert json.loads(Path(lock.path).read_text())["token"] == lock.lease["token"]
    assert os.listdir(tmp_path) == []  # lease and its flock guard file gone
    with RunLock(tmp_path, "codex again"):
        pass


def test_stale_heartbeat_is_taken_over_and_the_old_holder_finds_out(tmp_path, caplog):
    old = RunLock(tmp_path, "codex old", heartbeat=3600).acquire()  # alive, but its heartbeat stops
    time.sleep(0.3)
    new = RunLock(tmp_path, "codex new", stale_after=0.2).acquire()
    try:
        assert "taking over the stale lock" in caplog.text
        assert "`codex old`" in caplog.text and "its last heartbeat was" in caplog.text
        with pytest.raises(LockLost, match="taken over by `codex new`"):
            old.refresh()
        old.release()  # must not delete the new holder's lease
        assert json.loads(Path(new.path).read_text())["command"] == "codex new"
    finally:
        new.release()
    assert not Path(new.path).exists()


def test_lost_lease_stops_the_holder_from_its_heartbeat(tmp_path):
    lost = []
    old = RunLock(
        tmp_path, "codex old", heartbeat=0.1, on_lost=lambda lock, err: lost.append(str(err))
    ).acquire()
    Path(old.path).write_text(
        json.dumps(
            {
                "host": "elsewhere",
                "pid": 1,
                "command": "codex intruder",
                "started": time.time(),
                "heartbeat": time.time(),
                "token": "x",
            }
        )
    )
    wait_for(lambda: lost, 5, "the lost-lease callback")
    assert "taken over by `codex intruder` (pid 1 on host elsewhere" in lost[0]


def test_exceptions_release_and_only_rank_0_holds(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="boom"):
        with runlock.hold(str(tmp_path / "typo"), "codex test"):
            assert (tmp_path / "typo" / runlock.LEASE_NAME).exists()
            raise ValueError("boom")
    assert not (tmp_path / "typo").exists()  # a folder made only for the lock goes too
    monkeypatch.setenv("RANK", "1")
    with runlock.hold(str(tmp_path / "r1"), "codex test"):
        assert not (tmp_path / "r1").exists()  # rank 1 takes no lease
    monkeypatch.setenv("RANK", "0")
    with runlock.hold(str(tmp_path / "r0"), "codex test"):
        assert (tmp_path / "r0" / runlock.LEASE_NAME).exists()


def test_unreadable_lease_is_taken_over(tmp_path, caplog):
    (tmp_path / runlock.LEASE_NAME).write_text("{half a lea")
    with RunLock(tmp_path, "codex test"):
        assert "unreadable" in caplog.text


def test_racing_acquirers_exactly_one_wins(tmp_path):
    """Eight acquirers at once (separate open files, so only the flock guard orders them)."""
    barrier, wins, refused = threading.Barrier(8), [], []

    def go(i):
        lock = RunLock(tmp_path, f"codex racer {i}", heartbeat=3600)
        barrier.wait()
        try:
            wins.append(lock.acquire())
        except LockHeld:
            refused.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(refused) == 7
    assert (
        json.loads((tmp_path / runlock.LEASE_NAME).read_text())["token"] == wins[0].lease["token"]
    )
    wins[0].release()


# --- gs:// ---------------------------------------------------------------------------------------


def _lease(command: str, host: str = "other-host", pid: int = 4242, age: float = 0.0) -> dict:
    t = time.time() - age
    return {
        "host": host,
        "pid": pid,
        "command": command,
        "started": t,
        "heartbeat": t,
        "token": command,
    }


@pytest.mark.gcs
def test_gcs_lease_refuses_a_second_writer_and_takes_over_a_stale_heartbeat(gcs_bucket, caplog):
    run = f"{gcs_bucket}/run"
    with RunLock(run, "codex train", heartbeat=0.1) as lock:
        store = lock._store
        first, gen = store.read()
        assert (first["pid"], first["host"], first["command"]) == (os.getpid(), HOST, "codex train")
        wait_for(lambda: store.read()[1] != gen, 10, "a heartbeat (a new generation)")
        with pytest.raises(
            LockHeld, match=rf"in use by `codex train` \(pid {os.getpid()} on host {HOST}, since "
        ):
            RunLock(run, "codex train").acquire()
    assert store.read() == (None, None)  # released

    # A holder on another host that stopped beating 5 minutes ago (a dead TPU VM).
    assert store.create(_lease("codex data shard", age=300)) is not None
    with RunLock(run, "codex train") as lock:
        assert "taking over the stale lock" in caplog.text
        assert "`codex data shard` (pid 4242 on host other-host" in caplog.text
        assert store.read()[0]["token"] == lock.lease["token"]
    # ... and one that beat a moment ago is respected, whatever host it is on.
    assert store.create(_lease("codex data shard", age=1)) is not None
    with pytest.raises(LockHeld, match="pid 4242 on host other-host"):
        RunLock(run, "codex train").acquire()


@pytest.fixture
def strict_gcs(monkeypatch):
    """The GCS emulator (in this process) answering ifGenerationMatch as GCS does: 412 unless the
    object's current generation (0 = absent) matches. The emulator itself ignores the parameter."""
    import re
    import urllib.parse

    from gcp_storage_emulator import server as emu
    from gcp_storage_emulator.exceptions import NotFound

    orig = emu.Router.handle

    def handle(self, method):
        req = self._request_handler
        url = urllib.parse.urlsplit(req.path)
        query = urllib.parse.parse_qs(url.query)
        m = re.search(r"/b/([^/]+)/o(?:/(.+))?$", url.path)
        if "ifGenerationMatch" in query and m:
            name = urllib.parse.unquote(m.group(2)) if m.group(2) else query["name"][0]
            try:
                current = req.storage.get_file_obj(m.group(1), name)["generation"]
            except NotFound:
                current = "0"
            # one server thread: check + write are atomic
            if str(current) != query["ifGenerationMatch"][0]:
                body = b'{"error": {"code": 412, "message": "Precondition Failed"}}'
                req.send_response(412)
                req.send_header("Content-Type", "application/json")
                req.send_header("Content-Length", str(len(body)))
                req.end_headers()
                req.wfile.write(body)
                return
        return orig(self, method)

    monkeypatch.setattr(emu.Router, "handle", handle)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = emu.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    import gcsfs

    gcsfs.GCSFileSystem(endpoint_url=url, token="anon").mkdir("strict")
    yield "gs://strict"
    server.stop()
    gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.mark.gcs
def test_gcs_every_lease_change_is_conditional_on_the_generation(strict_gcs):
    """Two writers that read the same state: only the first change lands (create, takeover,
    heartbeat, release alike), so two takers of one stale lease can never both hold it."""
    store = runlock._GcsLease(f"{strict_gcs}/run/{runlock.LEASE_NAME}")
    g1 = store.create(_lease("a"))
    # ifGenerationMatch=0: already there
    assert g1 is not None and store.create(_lease("b")) is None
    g2 = store.swap(g1, _lease("b"))  # takeover from the generation read
    assert g2 is not None and g2 != g1
    assert store.swap(g1, _lease("c")) is None  # the slower taker read g1 too: refused
    assert store.read()[0]["token"] == "b" and store.read()[1] == g2
    assert store.delete(g1) is False and store.read()[1] == g2
    assert store.delete(g2) is True and store.read() == (None, None)

    winners = []  # and through RunLock, racing

    def go(i):
        try:
            winners.append(
                RunLock(f"{strict_gcs}/run", f"codex racer {i}", heartbeat=3600).acquire()
            )
        except LockHeld:
            pass

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and store.read()[0]["token"] == winners[0].lease["token"]
    winners[0].release()
