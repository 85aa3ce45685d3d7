"""pipeline/executor/, local processes: --workers N runs units in this process and N-1 pool
processes; every process takes the next unit from the front of the list (units start in order)."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import signal
import time
from pathlib import Path

import pytest

from codex.pipeline import executor
from codex.pipeline.executor import Where, run_units, stage_pool
from codex.pipeline.executor.policy import in_flight_limit, machine_memory


def who(unit: int) -> tuple[int, int]:
    """(unit, the pid that ran it); unit 0 (the pool's first) and -1 (the driver's) raise."""
    if unit in (0, -1):
        raise ValueError(f"bad unit {unit}")
    time.sleep(0.02)
    return unit, os.getpid()


def die_in_the_pool(unit: int) -> int:
    if unit == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
    return unit


def set_env(unit: int) -> int:
    os.environ["RAYON_NUM_THREADS"] = "1"  # as shard's encode unit does for its process
    os.environ.pop("CODEX_TEST_GONE", None)
    return unit


def test_two_workers_are_this_process_and_one_in_the_pool():
    units = list(range(1, 9))
    with stage_pool(Where(workers=2)) as where:
        assert where.pool is not None and where.pool._max_workers == 1  # the driver is the other
        cf.wait(where.started)  # the pool's process is up: fed its first unit at once
        got = dict(r for _, r in run_units(who, units, where))
    assert sorted(got) == units  # each unit once
    pids = set(got.values())
    assert os.getpid() in pids and len(pids) == 2
    # the pool's process is fed the first unit, the driver takes the next: both from the front
    assert got[1] != os.getpid() and got[2] == os.getpid()


def note_pid(folder: str) -> None:
    """A pool process's warm: one file a call, named by its pid."""
    with open(os.path.join(folder, f"{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass


def slow(unit: int) -> tuple[int, int]:
    time.sleep(0.3)
    return unit, os.getpid()


def test_every_pool_process_warms_once_and_takes_one_of_the_first_units(tmp_path):
    """Four workers: three pool processes, each warmed exactly once before its first task, and
    the pool's first tasks done only when all three are up, so its first three units go to three
    processes (none queued behind a sibling while another idles)."""
    with stage_pool(Where(workers=4), functools.partial(note_pid, str(tmp_path))) as where:
        cf.wait(where.started)
        warmed = [p.name.split("-")[0] for p in tmp_path.iterdir()]
        assert len(warmed) == 3 and len(set(warmed)) == 3, warmed
        got = dict(r for _, r in run_units(slow, [1, 2, 3, 4], where))
    assert got[4] == os.getpid()  # the next in line once each pool process has one
    assert {str(got[u]) for u in (1, 2, 3)} == set(warmed)


def test_a_units_exception_is_raised_here_from_either_process():
    with stage_pool(Where(workers=2)) as where:
        cf.wait(where.started)
        with pytest.raises(ValueError, match="bad unit 0"):  # the pool's first unit
            list(run_units(who, [0, 1, 2, 3], where))
        with pytest.raises(ValueError, match="bad unit -1"):  # the driver's first unit
            list(run_units(who, [1, -1, 2, 3], where))
        # the pool goes on serving the stage's next phase
        assert sorted(u for u, _ in run_units(who, [1, 2, 3], where)) == [1, 2, 3]


def test_a_dead_pool_process_fails_the_run_and_nothing_hangs():
    with stage_pool(Where(workers=2)) as where:
        cf.wait(where.started)
        with pytest.raises(cf.process.BrokenProcessPool):
            list(run_units(die_in_the_pool, list(range(8)), where))


def test_a_unit_run_here_leaves_the_environment_as_it_was(monkeypatch):
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    monkeypatch.setenv("CODEX_TEST_GONE", "x")
    assert sorted(u for u, _ in run_units(set_env, [1, 2, 3], Where(workers=2))) == [1, 2, 3]
    assert "RAYON_NUM_THREADS" not in os.environ
    assert os.environ["CODEX_TEST_GONE"] == "x"


class _AtTeardown:
    """Writes a file when the interpreter tears its modules down (a pool process should not)."""

    def __init__(self, path: str):
        self.path, self.open = path, open  # builtins may be gone by then

    def __del__(self):
        with self.open(self.path, "w"):
            pass


_held: list = []


def log_and_hold(folder: str, unit: int) -> int:
    import logging

    logging.getLogger("codex.test").warning("unit %d in pool process %d", unit, os.getpid())
    _held.append(_AtTeardown(os.path.join(folder, f"teardown-{os.getpid()}")))
    time.sleep(0.05)
    return os.getpid()


def test_a_pool_process_leaves_without_teardown_and_its_log_lines_reach_the_file(tmp_path):
    """At the stage's end the driver waits for its pool processes to exit: they skip the
    interpreter's teardown (no module's objects are destroyed) but flush their log lines first."""
    from codex.core import progress

    path = progress.log_to_file(str(tmp_path), "codex data test")
    try:
        with stage_pool(Where(workers=2)) as where:
            cf.wait(where.started)
            pids = {
                p
                for _, p in run_units(
                    functools.partial(log_and_hold, str(tmp_path)), [1, 2, 3, 4], where
                )
            }
    finally:
        progress.close_log_file()
    (pool_pid,) = pids - {os.getpid()}
    assert f"in pool process {pool_pid}" in open(path).read()
    assert not (tmp_path / f"teardown-{pool_pid}").exists()
    # the same object in a process that exits normally does write its file (the check can fail)
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[3])
    code = (
        f"import sys; sys.path.insert(0, {root!r}); "
        "from tests.pipeline.executor.test_executor import _AtTeardown; "
        f"x = _AtTeardown({str(tmp_path / 'normal')!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert (tmp_path / "normal").exists()


def test_one_worker_runs_every_unit_here():
    got = [r for _, r in run_units(who, [1, 2], Where(workers=1))]
    assert {pid for _, pid in got} == {os.getpid()}
    assert executor.slots(Where(workers=3)) == 3  # units side by side: the driver counts


# --- the failure policy, the tasks' settings and log files (data.task.*) ----------------------


def slow_or_bad(folder: str, unit: int) -> int:
    """Units 1 and 3 fail at once; the others take a moment, then leave a file (their
    'marker')."""
    if unit in (1, 3):
        raise ValueError(f"bad unit {unit}")
    time.sleep(0.3)
    open(os.path.join(folder, f"done-{unit}"), "w").close()
    return unit


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failing_unit_stops_no_other_then_raises_naming_the_failed(tmp_path, caplog, workers):
    """Units 1 and 3 fail, in this process or the pool's: every other unit still runs, is
    yielded and leaves its marker; then unit 1's own exception is raised after one error line
    naming both."""
    fn = functools.partial(slow_or_bad, str(tmp_path))
    got = []
    with stage_pool(Where(workers=workers)) as where:
        cf.wait(where.started)
        with caplog.at_level("ERROR", logger="codex.executor"):
            with pytest.raises(ValueError, match="bad unit [13]"):
                for unit, _ in run_units(fn, [0, 1, 2, 3, 4, 5], where):
                    got.append(unit)
    assert sorted(got) == [0, 2, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"done-{u}" for u in (0, 2, 4, 5)]
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "slow_or_bad: 2 of 6 unit(s) failed: " in line, line
    assert sorted(line.split("failed: ")[1].split(" (")[0].split(", ")) == ["1", "3"], line
    assert "(ValueError: bad unit " in line and "the other 4 finished" in line, line


def test_a_unit_that_fails_leaves_the_others_done_and_a_rerun_runs_only_it(tmp_path, monkeypatch):
    """clean's second unit fails: the stage still runs every other unit (each leaves its marker),
    then fails; a rerun runs only the failed unit and gives what an undisturbed run gives."""
    from codex.pipeline.clean import clean as C
    from tests.fixtures.clean import cfg_for, make_corpus, snapshot

    make_corpus(tmp_path / "in", 4, 30)
    args = ["data.clean.chunk_bytes=4000", "data.clean.workers=1"]
    ref = C.run_clean(cfg_for(tmp_path, [tmp_path / "in"], *args, run="ref"))
    assert ref["units"] >= 4, ref
    real = C.clean_unit

    @functools.wraps(real)
    def second_fails(job):
        if job.unit.index == 1:
            raise ValueError("unit 1 cannot be read")
        return real(job)

    monkeypatch.setattr(C, "clean_unit", second_fails)
    cfg = cfg_for(tmp_path, [tmp_path / "in"], *args)
    with pytest.raises(ValueError, match="unit 1 cannot be read"):
        C.run_clean(cfg)
    markers = tmp_path / "run" / "clean" / "markers"
    assert len(list(markers.glob("*.json"))) == ref["units"] - 1
    monkeypatch.setattr(C, "clean_unit", real)
    again = C.run_clean(cfg)
    assert again.pop("units_run") == 1
    ref.pop("units_run")
    assert again == ref
    assert snapshot(tmp_path / "run") == snapshot(tmp_path / "ref")


def flaky(folder: str, unit: int) -> int:
    """Fails with a dropped connection on its first attempt, then succeeds; counts attempts."""
    tries = os.path.join(folder, f"tries-{unit}")
    with open(tries, "a") as f:
        f.write("x")
    if os.path.getsize(tries) == 1:
        raise ConnectionResetError(104, "Connection reset by peer")
    return unit


def bad_input(folder: str, unit: int) -> int:
    with open(os.path.join(folder, f"tries-{unit}"), "a") as f:
        f.write("x")
    raise ValueError(f"row 3 of unit {unit}: not valid JSON")


def test_a_transient_io_error_runs_the_unit_again_bad_input_does_not(tmp_path):
    policy = executor.TaskPolicy(io_retries=2)
    fn = functools.partial(flaky, str(tmp_path))
    assert [u for u, _ in run_units(fn, [7], Where(task=policy))] == [7]
    assert (tmp_path / "tries-7").read_text() == "xx"
    with pytest.raises(ValueError, match="not valid JSON"):
        list(run_units(functools.partial(bad_input, str(tmp_path)), [8], Where(task=policy)))
    assert (tmp_path / "tries-8").read_text() == "x"  # once: it would fail the same way again
    with pytest.raises(ConnectionResetError):  # no retries: the first error stands
        list(run_units(fn, [9], Where(task=executor.TaskPolicy(io_retries=0))))


@pytest.mark.parametrize(
    "error, transient",
    [
        (ConnectionResetError(104, "reset"), True),
        (TimeoutError("read timed out"), True),
        (OSError(5, "Input/output error"), True),  # EIO
        (OSError(28, "No space left on device"), False),
        (FileNotFoundError(2, "gone"), False),
        (PermissionError(13, "denied"), False),
        (ValueError("not valid JSON"), False),
    ],
)
def test_which_errors_are_transient(error, transient):
    from codex.core import fsio

    assert fsio.is_transient(error) is transient


def test_gcsfs_http_errors_429_and_5xx_are_transient_404_is_not():
    from gcsfs.retry import HttpError

    from codex.core import fsio

    def http(code: int) -> HttpError:
        return HttpError({"code": code, "message": f"status {code}"})

    assert [fsio.is_transient(http(c)) for c in (429, 500, 503, 404, 403)] == [
        True,
        True,
        True,
        False,
        False,
    ]
    try:  # a reader's error raised from a transient one is transient too
        raise ValueError("part-00001.parquet: cannot read") from http(503)
    except ValueError as e:
        assert fsio.is_transient(e)


def sleeper(unit: int) -> int:
    time.sleep(60)
    return unit


@pytest.mark.parametrize("workers", [1, 2])
def test_a_unit_past_its_timeout_is_stopped_and_fails_naming_it(workers):
    """workers=1: the unit runs in this process; 2: in the pool's (both: their main thread).
    Each attempt is stopped: the first, then its one retry (io_retries=1)."""
    where = Where(workers=workers, task=executor.TaskPolicy(timeout_s=0.5, io_retries=1))
    with stage_pool(where) as where:
        cf.wait(where.started)
        with pytest.raises(
            executor.UnitTimeout, match=r"sleeper [34] ran past .*timeout_s=0.5s.*attempt 2 of 2"
        ):
            list(run_units(sleeper, [3, 4], where))


def slow_the_first_time(folder: str, unit: int) -> int:
    """Hangs on its first attempt (past any timeout), returns on the next; counts attempts."""
    tries = os.path.join(folder, f"tries-{unit}")
    with open(tries, "a") as f:
        f.write("x")
    if os.path.getsize(tries) == 1:
        time.sleep(60)
    return unit


@pytest.mark.parametrize("workers", [1, 2])
def test_a_unit_that_timed_out_runs_again_and_the_stage_finishes(tmp_path, workers):
    fn = functools.partial(slow_the_first_time, str(tmp_path))
    policy = executor.TaskPolicy(timeout_s=0.5, io_retries=2)
    where = Where(workers=workers, task=policy, logs=str(tmp_path / "logs"))
    with stage_pool(where) as where:
        cf.wait(where.started)
        assert sorted(u for u, _ in run_units(fn, [5, 6], where)) == [5, 6]
    for unit in (5, 6):
        assert (tmp_path / f"tries-{unit}").read_text() == "xx"  # stopped once, then passed
        text = (tmp_path / "logs" / "slow_the_first_time" / f"{unit}.log").read_text()
        assert "ran past data.task.timeout_s=0.5s and was stopped; run again (1/2)" in text, text
        assert f"slow_the_first_time {unit}: done in" in text, text


def test_the_memory_reservation_caps_the_local_processes(caplog):
    from codex.core.config import Config

    cfg = Config()
    assert executor.where_for(cfg.data, 4).workers == 4
    # a unit reserving 60% of the machine: one process fits
    cfg.data.task.memory_gb = 0.6 * machine_memory() / 1e9
    with caplog.at_level("WARNING", logger="codex.executor"):
        where = executor.where_for(cfg.data, 4)
    assert where.workers == 1
    assert where.task.memory_bytes == int(cfg.data.task.memory_gb * 1e9)
    assert "1 worker(s) fit in this machine's" in caplog.text


def test_a_phase_gets_its_own_memory_and_timeout_and_a_bad_item_names_its_key():
    from codex.core.config import ConfigError, build_config
    from codex.pipeline.executor.task import task_specs

    by_phase = "data.task.memory_gb_by_phase=slow=2,pack_group=1"
    cfg = build_config(overrides=[by_phase, "data.task.timeout_s_by_phase=slow=30"])
    cfg.data.task.memory_gb = 0.5
    where = executor.where_for(cfg.data, 1)
    (mine,) = task_specs(slow, [1], where)
    (other,) = task_specs(warn_and_return, [1], where)
    assert (mine.policy.memory_bytes, mine.policy.timeout_s) == (2_000_000_000, 30.0)
    assert (other.policy.memory_bytes, other.policy.timeout_s) == (500_000_000, 0.0)
    cfg.data.task.timeout_s_by_phase = ["slow:30"]
    with pytest.raises(ConfigError, match="data.task.timeout_s_by_phase: 'slow:30' is not PHASE"):
        executor.where_for(cfg.data, 1)


def warn_and_return(unit: int) -> int:
    import logging

    logging.getLogger("codex.test").warning("unit %d says hello from %d", unit, os.getpid())
    logging.getLogger("somelib").warning("a library's warning in unit %d", unit)
    if unit == 3:
        raise ValueError("unit 3 is bad")
    return unit


def test_every_unit_leaves_a_log_file_of_its_own(tmp_path):
    where = Where(workers=2, logs=str(tmp_path / "logs"))
    with pytest.raises(ValueError, match="unit 3 is bad"):
        list(run_units(warn_and_return, [1, 2, 3], where))
    folder = tmp_path / "logs" / "warn_and_return"
    assert sorted(p.name for p in folder.iterdir()) == ["1.log", "2.log", "3.log"]
    for unit in (1, 2):
        text = (folder / f"{unit}.log").read_text()
        assert f"WARNING codex.test: unit {unit} says hello" in text, text
        assert f"WARNING somelib: a library's warning in unit {unit}" in text, text
        assert f"warn_and_return {unit}: done in" in text, text
        assert f"unit {3 - unit} says" not in text  # its own lines only
    bad = (folder / "3.log").read_text()
    assert "warn_and_return 3: failed after" in bad and "ValueError: unit 3 is bad" in bad, bad
    assert "Traceback" in bad, bad


def test_a_units_log_file_on_gcs_is_written_when_it_ends(gcs_bucket):
    from codex.core import fsio

    logs = f"{gcs_bucket}/run/logs"
    assert [u for u, _ in run_units(warn_and_return, [2], Where(logs=logs))] == [2]
    # its name starts with a hash of the unit's, as every unit object's on gs:// (fsio.spread)
    text = fsio.read_text(f"{logs}/warn_and_return/{fsio.spread(logs, '2')}.log")
    assert "WARNING codex.test: unit 2 says hello" in text and "done in" in text, text


# A process that runs one unit with its log on gs://, written again every 0.2 s: the unit logs a
# line, then hangs until the test kills the process (as the kernel does a unit out of memory)
_LOGS_THEN_HANGS = """import logging, sys, time
from codex.pipeline.executor import Where, logs, run_units
logs.UNIT_LOG_UPLOAD_S = 0.2
def hang_after_a_line(unit):
    logging.getLogger("codex.test").warning("unit %d got halfway", unit)
    time.sleep(120)
list(run_units(hang_after_a_line, [4], Where(logs=sys.argv[1])))
"""


@pytest.mark.slow
def test_a_unit_killed_mid_run_leaves_its_log_on_gcs(gcs_bucket):
    import subprocess
    import sys

    from codex.core import fsio

    logs = f"{gcs_bucket}/run/logs"
    path = f"{logs}/hang_after_a_line/{fsio.spread(logs, '4')}.log"
    root = str(Path(__file__).resolve().parents[3])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    proc = subprocess.Popen([sys.executable, "-c", _LOGS_THEN_HANGS, logs], env=env, cwd=root)
    try:
        text = ""
        deadline = time.monotonic() + 60
        while "got halfway" not in text and time.monotonic() < deadline:
            assert proc.poll() is None, "the unit's process ended"
            time.sleep(0.1)
            text = fsio.read_text(path) if fsio.exists(path) else ""
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    text = fsio.read_text(path)  # what the killed unit left
    assert "hang_after_a_line 4: started on" in text, text
    assert "WARNING codex.test: unit 4 got halfway" in text, text
    assert "done in" not in text and "failed after" not in text, text


def test_the_ray_in_flight_limit_queues_demand_beyond_the_cpus():
    """A 0-CPU head with workers scaling from zero still gets `pending` units to show the
    autoscaler; a big cluster keeps each CPU busy and one unit queued for each."""
    assert in_flight_limit(0, 16) == 16
    assert in_flight_limit(4, 16) == 20
    assert in_flight_limit(500, 16) == 1000
    assert in_flight_limit(0, 0) == 1  # never none
