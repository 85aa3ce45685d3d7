"""A Ray cluster that is not there, or goes away: the data stages on Ray say so in one line and
exit, and a Ray cluster ending never takes a process that ran a stage on it down with it.

- nothing answers at --ray-address: exit 2 at once, one line naming the address;
- the head of the cluster is killed mid-clean: exit 1 within 30 s of the kill, one line naming the
  address and saying that a rerun resumes; a rerun on a new cluster gives the same bytes as an
  undisturbed run;
- a stage detaches its Ray driver when it ends: a process that ran one (the test suite) outlives
  that cluster's end, and the suite's own cluster teardown never ends someone else's Ray.

The clusters here are real (conftest's RayCluster: `ray start` nodes in sessions of their own, ended
by killing those, never `ray stop`)."""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from codex.pipeline.clean.clean import run_clean
from tests import conftest
from tests.fixtures.clean import cfg_for, ray_corpus
from tests.fixtures.procs import RayCluster

ROOT = Path(__file__).resolve().parents[3]
CODEX = str(Path(sys.executable).parent / "codex")

pytestmark = pytest.mark.skipif(
    not conftest.RAY_EXE.exists(), reason="Ray is not installed: pip install -e '.[ray]'"
)


def _env(**extra: str) -> dict[str, str]:
    """The environment of a codex process started here: this checkout's code first."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, RAY_AUTH_MODE="disabled", **extra)
    env.pop("CODEX_DEBUG", None)
    return env


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("Error:")]


# Ray's own lines on a terminal: its C++ log lines ("[2026-11-27 17:49:16,708 E 15478 15528]
# rpc_client.h:204: Failed to connect to GCS within 60 seconds ... The program will terminate"),
# its Python loggers' through codex's handler ("17:49:16 ERROR ray._private.worker: ...") or
# through its own ("2026-11-27 17:49:16,708\tERROR worker.py:...").
RAY_LINE = re.compile(
    r"^\[\d{4}-\d\d-\d\d [\d:,]+ [A-Z] \d+ \d+\]|^\S+ [A-Z]+ ray[.:]|^\d{4}-\d\d-\d\d [\d:,]+\s"
    r"|Failed to connect to GCS",
    re.M,
)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--ray-address", "RAY_ADDRESS"])
def test_nothing_at_the_ray_address_exits_2_at_once_naming_it(tmp_path, how):
    ray_corpus(tmp_path / "in", big_docs=20, small_files=1)
    address = f"127.0.0.1:{_unused_port()}"
    cmd = [CODEX, "data", "clean", "--run", str(tmp_path / "run"), "--input", str(tmp_path / "in")]
    cmd += ["--executor", "ray"]
    env = _env()
    if how == "RAY_ADDRESS":
        env["RAY_ADDRESS"] = address
    else:
        cmd += ["--ray-address", address]
        env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired as e:
        err = (e.stderr or b"").decode(errors="replace")[-1500:]
        pytest.fail(f"still running after 45 s, nothing answering at {address}:\n{err}")
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr
    assert took < 10, f"{took:.1f} s"
    # one line (after click's usage lines): the address, where it was set, and what to do
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert [ln for ln in lines if not ln.startswith(("Usage:", "Try '"))] == _errors(res.stderr)
    (line,) = _errors(res.stderr)
    assert address in line and "no Ray cluster answers there" in line, line
    assert ("data.ray_address" if how == "--ray-address" else "$RAY_ADDRESS") in line, line
    assert "ray start --head" in line, line
    assert not (tmp_path / "run" / "clean").exists()  # refused before it touched anything


@pytest.mark.slow
def test_rays_own_stderr_lines_go_to_the_log_file_the_rest_through_unchanged(capfd, caplog):
    """While the driver is attached, fd 2 goes through logs.RayLinesToLogFile: Ray's C++ lines
    (its core worker writes its errors to stderr) are filed in the log, whole even when written in
    pieces or after a progress bar's line; every other byte reaches stderr as written."""
    from codex.pipeline.executor import logs

    ray_line = b"[2026-11-27 17:57:05,433 E 24641 24661] task_manager.cc:1545: Failed to push"
    with caplog.at_level(logging.INFO, logger="codex.executor"):
        lines = logs.RayLinesToLogFile()
        try:
            os.write(2, b"12:00:00 INFO codex: a line\n")
            os.write(2, b"\r\x1b[2Kclean:  10% 1/10 units" + ray_line + b"\n")
            os.write(2, b"[2026-11-27 17:57:06,001 W 24641 24661] rpc_cl")
            time.sleep(0.05)
            os.write(2, b"ient.h:204: written in two pieces\nnext [1/2] line\n")
            os.write(2, b"\r\x1b[2Kclean:  20% 2/10 units")
        finally:
            lines.close()
    assert capfd.readouterr().err == (
        "12:00:00 INFO codex: a line\n\r\x1b[2Kclean:  10% 1/10 units"
        "next [1/2] line\n\r\x1b[2Kclean:  20% 2/10 units"
    )
    filed = [r.getMessage() for r in caplog.records if r.name == "codex.executor"]
    assert filed == [
        "ray: " + ray_line.decode(),
        "ray: [2026-11-27 17:57:06,001 W 24641 24661] rpc_client.h:204: written in two pieces",
    ]
    assert all(getattr(r, "file_only", False) for r in caplog.records)


@pytest.mark.slow
def test_a_ray_stage_leaves_no_driver_attached(tmp_path, ray_cluster):
    """The stage's ray.init is undone when the stage ends: nothing ties this process to the
    cluster between stages (conftest's _no_ray_driver_left_attached checks it after every test)."""
    ray_corpus(tmp_path / "in", big_docs=60, small_files=2)
    cfg = cfg_for(tmp_path, [tmp_path / "in"], "data.clean.chunk_bytes=20000")
    cfg.data.executor, cfg.data.ray_address = "ray", ray_cluster
    assert run_clean(cfg)["units"] >= 3
    import ray

    assert not ray.is_initialized()


# A process that runs a Ray stage on one cluster, waits until the test has ended that cluster (by
# its processes), lets Ray's reconnect timeout (5 s here, 60 s by default) pass, then runs a Ray
# stage on another cluster. An attached driver would be ended by Ray's core worker meanwhile,
# status 1: what ended the test suite when someone's `ray stop` ended its cluster.
_SURVIVOR = """import sys, time
from pathlib import Path
from codex.pipeline.clean.clean import run_clean
from tests.fixtures.clean import cfg_for
tmp, other, suite, flag = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
def clean(run, address):
    cfg = cfg_for(tmp, [tmp / "in"], "data.clean.chunk_bytes=20000", run=run)
    cfg.data.executor, cfg.data.ray_address = "ray", address
    return run_clean(cfg)["units"]
print("other cluster:", clean("other", other), "units", flush=True)
deadline = time.time() + 120
while not flag.exists() and time.time() < deadline:
    time.sleep(0.05)
time.sleep(10)
print("suite cluster:", clean("suite", suite), "units", flush=True)
"""


@pytest.mark.slow
def test_a_process_that_ran_a_ray_stage_outlives_that_cluster(tmp_path, ray_cluster):
    ray_corpus(tmp_path / "in", big_docs=60, small_files=2)
    other = RayCluster.start(nodes=1, prefix="rayo")
    try:
        flag = tmp_path / "other-stopped"
        proc = subprocess.Popen(
            [sys.executable, "-c", _SURVIVOR, str(tmp_path), other.address, ray_cluster, str(flag)],
            cwd=ROOT,
            env=_env(RAY_gcs_rpc_server_reconnect_timeout_s="5"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the stage on the other cluster finished
        other.stop()
        flag.touch()
        out, err = proc.communicate(timeout=180)
    finally:
        other.stop()
    assert first.startswith("other cluster:"), err[-3000:]
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{err[-3000:]}"
    assert out.startswith("suite cluster:"), out
    assert "Failed to connect to GCS" not in err, err[-3000:]


@pytest.mark.slow
def test_the_suites_ray_fixture_never_ends_another_ray(tmp_path, gcs_emulator, monkeypatch):
    """Someone's own Ray cluster on the machine outlives the suite's cluster fixture: its start,
    its teardown, and a start that fails (`ray stop --force` in any of them would end it)."""
    users = RayCluster.start(nodes=1, prefix="rayu")
    try:
        before = set(users.processes())
        fixture = conftest.ray_cluster.__wrapped__(gcs_emulator)  # the fixture's own code
        address = next(fixture)
        assert address != users.address
        with pytest.raises(StopIteration):  # its teardown
            next(fixture)
        assert users.answers() and before <= set(users.processes())
        # a start that fails: a temp dir too long for Ray's socket paths
        long = tempfile.mkdtemp(prefix="ray" + "x" * 110, dir="/tmp")
        monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: long)
        with pytest.raises(pytest.skip.Exception, match="Ray cannot start a cluster here"):
            next(conftest.ray_cluster.__wrapped__(gcs_emulator))
        monkeypatch.undo()
        assert users.answers() and before <= set(users.processes())
        # and a driver still runs a stage on it
        ray_corpus(tmp_path / "in", big_docs=40, small_files=1)
        cfg = cfg_for(tmp_path, [tmp_path / "in"], "data.clean.chunk_bytes=20000")
        cfg.data.executor, cfg.data.ray_address = "ray", users.address
        assert run_clean(cfg)["units"] >= 2
    finally:
        users.stop()
    assert not users.processes()


def _clean_cmd(run: Path, inputs: Path, address: str) -> list[str]:
    return [CODEX, "data", "clean", "--run", str(run), "--input", str(inputs)] + [
        "--set",
        "data.clean.chunk_bytes=500000",
        "--executor",
        "ray",
        "--ray-address",
        address,
    ]


@pytest.mark.slow
def test_a_lost_ray_head_mid_clean_ends_in_one_line_and_a_rerun_resumes(tmp_path):
    """The head node (GCS and raylet) killed at 44% of the units: one codex line naming the
    address and the rerun, exit 1, within 30 s of the kill (Ray alone: its C++ line, 60 s later);
    a rerun on a new cluster does only the unfinished units and gives the bytes of an
    undisturbed run."""
    ray_corpus(tmp_path / "in", big_docs=18000, small_files=0)
    ref = run_clean(
        cfg_for(tmp_path, [tmp_path / "in"], "data.clean.chunk_bytes=500000", run="ref")
    )
    units = ref["units"]
    assert units >= 20, units
    run = tmp_path / "run"
    markers = run / "clean" / "markers"
    cluster = RayCluster.start(nodes=2, prefix="rayh")
    try:
        with open(tmp_path / "err.txt", "w") as err:
            proc = subprocess.Popen(
                _clean_cmd(run, tmp_path / "in", cluster.address),
                env=_env(),
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
            deadline = time.monotonic() + 180
            while len(list(markers.glob("*.json"))) < math.ceil(0.44 * units):
                assert proc.poll() is None, (tmp_path / "err.txt").read_text()
                assert time.monotonic() < deadline, "no units finished in 180 s"
                time.sleep(0.02)
            cluster.kill(0)  # the head: its GCS, raylet and workers
            killed = time.monotonic()
            done_at_kill = len(list(markers.glob("*.json")))
            try:
                rc = proc.wait(timeout=120)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
            took = time.monotonic() - killed
            print(f"exit {rc} {took:.1f} s after the kill, {done_at_kill} of {units} units done")
    finally:
        cluster.stop()  # the second node too: what it was running ends
    stderr = (tmp_path / "err.txt").read_text()
    assert done_at_kill < units, "the stage finished before the head was killed"
    assert rc == 1, f"exit {rc} {took:.1f} s after the kill:\n{stderr[-3000:]}"
    assert took <= 30, f"{took:.1f} s after the kill:\n{stderr[-3000:]}"
    errors = _errors(stderr)
    assert len(errors) == 1, stderr[-3000:]
    assert cluster.address in errors[0] and "rerun" in errors[0], errors[0]
    assert "only the unfinished units" in errors[0], errors[0]
    # Ray's own lines went to the log file, not the terminal
    assert not RAY_LINE.findall(stderr.replace(errors[0], "")), stderr[-3000:]
    assert (run / "logs" / "clean.log").exists()
    assert not (run / "clean" / "stats.json").exists()
    done = len(list(markers.glob("*.json")))

    again = RayCluster.start(nodes=1, prefix="rayr")
    try:
        res = subprocess.run(
            _clean_cmd(run, tmp_path / "in", again.address),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        again.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    planned = re.search(r"(\d+) units, (\d+) to do on ray", res.stderr)
    assert planned, res.stderr[-3000:]
    assert (int(planned[1]), int(planned[2])) == (units, units - done), res.stderr[-3000:]
    ref_dir, got_dir = tmp_path / "ref" / "clean", run / "clean"
    names = sorted(p.name for p in ref_dir.glob("part-*"))
    assert sorted(p.name for p in got_dir.glob("part-*")) == names and names
    for name in [*names, "stats.json"]:
        assert (got_dir / name).read_bytes() == (ref_dir / name).read_bytes(), name
    assert not list(got_dir.rglob(".tmp-*"))


# --- the failure policy, the tasks' settings and log files on Ray (data.task.*) ----------------


def _slow_or_bad(folder: str, unit: int) -> int:
    """Unit 1 fails at once; the others take a moment, then leave a file (their 'marker')."""
    if unit == 1:
        raise ValueError(f"bad unit {unit}")
    time.sleep(0.3 if unit == 0 else 0.05)
    Path(folder, f"done-{unit}").touch()
    return unit


def _slow_the_first_time(folder: str, unit: int) -> int:
    """Hangs on its first attempt (past any timeout), returns on the next; counts attempts."""
    tries = Path(folder, f"tries-{unit}")
    with open(tries, "a") as f:
        f.write("x")
    if tries.read_text() == "x":
        time.sleep(120)
    return unit


def _sleeper(unit: int) -> int:
    time.sleep(120)
    return unit


@pytest.mark.slow
def test_on_ray_a_failing_unit_stops_no_other_and_a_unit_that_timed_out_runs_again(
    tmp_path, ray_cluster, caplog
):
    """Two CPUs, no extra units queued (ray_pending 0): 4 units in flight. Unit 1 fails while
    unit 0 runs: every other unit still runs and is handed on, then unit 1's ValueError is raised
    after one line naming it. A unit past data.task.timeout_s is stopped in its worker and runs
    again: the stage finishes when the retry passes; one that never finishes fails naming it
    (UnitTimeout) once its retries are spent."""
    from codex.pipeline import executor

    where = executor.Where("ray", 2, ray_cluster, executor.TaskPolicy(ray_pending=0))
    fn = functools.partial(_slow_or_bad, str(tmp_path))
    got = []
    with executor.stage_pool(where) as where:
        with caplog.at_level(logging.INFO, logger="codex.executor"):
            with pytest.raises(ValueError, match="bad unit 1"):
                for unit, _ in executor.run_units(fn, list(range(12)), where):
                    got.append(unit)
        everyone_else = [u for u in range(12) if u != 1]
        assert sorted(got) == everyone_else, got
        done = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("done-*"))
        assert done == everyone_else, done
        assert "ray: 2 CPUs in the cluster: up to 4 units in flight" in caplog.text
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert (
            len(errors) == 1 and "_slow_or_bad: 1 of 12 unit(s) failed: 1 (ValueError" in errors[0]
        )

        policy = executor.TaskPolicy(timeout_s=1.0, io_retries=1)
        timed = replace(where, task=policy)
        slow = functools.partial(_slow_the_first_time, str(tmp_path))
        assert sorted(u for u, _ in executor.run_units(slow, [7, 8], timed)) == [7, 8]
        assert [Path(tmp_path, f"tries-{u}").read_text() for u in (7, 8)] == ["xx", "xx"]
        with pytest.raises(executor.UnitTimeout, match="_sleeper 5 ran past.*attempt 2 of 2"):
            list(executor.run_units(_sleeper, [5], timed))


def _report(folder: str, unit: int) -> dict:
    """Logs a warning; unit 1 fails with a dropped connection on its first attempt; returns the
    resources Ray gave its task."""
    import ray

    logging.getLogger("codex.test").warning("unit %d says hello from %d", unit, os.getpid())
    tries = Path(folder, f"tries-{unit}")
    with open(tries, "a") as f:
        f.write("x")
    if unit == 1 and tries.read_text() == "x":
        raise ConnectionResetError(104, "Connection reset by peer")
    return ray.get_runtime_context().get_assigned_resources()


@pytest.mark.slow
def test_on_ray_each_unit_reserves_its_memory_retries_transient_errors_and_logs_to_its_file(
    tmp_path, ray_cluster
):
    from codex.pipeline import executor

    policy = executor.TaskPolicy(memory_bytes=50 << 20, io_retries=1)
    where = executor.Where("ray", 2, ray_cluster, policy, logs=str(tmp_path / "logs"))
    fn = functools.partial(_report, str(tmp_path))
    got = dict(executor.run_units(fn, [0, 1], where))
    assert got[0] == {"CPU": 1.0, "memory": float(50 << 20)}, got
    assert (tmp_path / "tries-1").read_text() == "xx"  # run again, in its task
    folder = tmp_path / "logs" / "_report"
    assert sorted(p.name for p in folder.iterdir()) == ["0.log", "1.log"]
    for unit in (0, 1):
        text = (folder / f"{unit}.log").read_text()
        assert f"WARNING codex.test: unit {unit} says hello" in text, text
        assert f"_report {unit}: started on ray-node-" in text, text
    retried = (folder / "1.log").read_text()
    assert "transient error (ConnectionResetError" in retried, retried


def _wait_for(flag: str, unit: int) -> int:
    """Runs until the test lets the units go (at most 120 s)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return unit


@pytest.mark.slow
def test_the_ray_in_flight_limit_rises_when_a_node_joins_mid_stage(tmp_path, caplog):
    """A 1-node cluster: 2 units in flight (ray_pending 0). A second node joins while they run:
    the driver reads the cluster's CPUs again and keeps 4 in flight."""
    from codex.pipeline import executor

    cluster = RayCluster.start(nodes=1, prefix="rayn")
    flag = str(tmp_path / "go")
    rose = threading.Event()

    def add_a_node() -> None:
        try:
            deadline = time.monotonic() + 120
            while "up to 2 units in flight" not in caplog.text:  # the driver has started
                if time.monotonic() > deadline:
                    return
                time.sleep(0.1)
            cluster.add_node()
            while time.monotonic() < deadline:
                if "2 CPUs in the cluster: up to 4 units in flight" in caplog.text:
                    rose.set()
                    return
                time.sleep(0.1)
        finally:
            Path(flag).touch()  # the units go on either way

    where = executor.Where("ray", 1, cluster.address, executor.TaskPolicy(ray_pending=0))
    adder = threading.Thread(target=add_a_node, daemon=True)
    try:
        with caplog.at_level(logging.INFO, logger="codex.executor"):
            adder.start()
            fn = functools.partial(_wait_for, flag)
            got = sorted(u for u, _ in executor.run_units(fn, list(range(8)), where))
        adder.join(timeout=150)
    finally:
        cluster.stop()
    assert got == list(range(8))
    assert rose.is_set(), caplog.text[-3000:]
    assert "ray: 1 CPUs in the cluster: up to 2 units in flight" in caplog.text


def _noop(unit: int) -> int:
    return unit


@pytest.mark.slow
def test_the_ray_driver_scans_no_list_of_the_tasks_in_flight_per_finished_unit(
    ray_cluster, monkeypatch
):
    """512 units in flight: the driver learns of each finished unit without a ray.wait over
    every task in flight (that would scan 512 refs a unit: its CPU a unit would grow with the
    cluster). The refs ray.wait is given, over the units finished, stays under 1."""
    import ray

    from codex.pipeline import executor
    from codex.pipeline.executor import ray_tasks

    monkeypatch.setattr(ray_tasks, "in_flight_limit", lambda cpus, pending: 512)
    scanned = []
    real_wait = ray.wait

    def counting_wait(refs, *args, **kwargs):
        scanned.append(len(refs))
        return real_wait(refs, *args, **kwargs)

    monkeypatch.setattr(ray, "wait", counting_wait)
    where = executor.Where("ray", 2, ray_cluster, executor.TaskPolicy(ray_pending=0))
    with executor.stage_pool(where) as where:
        executor.slots(where)  # attached (its warm-up's ray.wait is before the units)
        scanned.clear()
        got = [u for u, _ in executor.run_units(_noop, list(range(700)), where)]
    assert sorted(got) == list(range(700))  # each unit once
    assert sum(scanned) / len(got) < 1, (len(scanned), sum(scanned))


def _noop_or_bad(unit: int) -> int:
    if unit == 777:
        raise ValueError(f"bad unit {unit}")
    return unit


@pytest.mark.slow
def test_short_units_run_several_a_ray_task_and_one_that_fails_fails_alone(
    ray_cluster, monkeypatch, caplog
):
    """4,000 no-op units, 16 tasks in flight: the driver hands them out in batches (far fewer
    tasks than units, the last ones single units), every unit is handed on once, and unit 777's
    failure fails it alone, in one line naming it."""
    from codex.pipeline import executor
    from codex.pipeline.executor import ray_tasks

    monkeypatch.setattr(ray_tasks, "in_flight_limit", lambda cpus, pending: 16)
    taken: list[int] = []
    take = ray_tasks._Batches.take

    def counting(self, limit: int) -> list:
        batch = take(self, limit)
        taken.append(len(batch))
        return batch

    monkeypatch.setattr(ray_tasks._Batches, "take", counting)
    where = executor.Where("ray", 2, ray_cluster, executor.TaskPolicy(ray_pending=0))
    got = []
    with caplog.at_level(logging.ERROR, logger="codex.executor"):
        with pytest.raises(ValueError, match="bad unit 777"):
            for unit, _ in executor.run_units(_noop_or_bad, list(range(4000)), where):
                got.append(unit)
    assert sorted(got) == [u for u in range(4000) if u != 777]
    assert sum(taken) == 4000 and len(taken) < 4000 / 4 and taken[-1] == 1, taken
    assert "_noop_or_bad: 1 of 4000 unit(s) failed: 777 (ValueError" in caplog.text
