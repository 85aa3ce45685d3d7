"""pipeline/executor.py, local processes: --workers N runs units in this process and N-1 pool
processes; every process takes the next unit from the front of the list (units start in order)."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import signal
import time

import pytest

from codex.pipeline import executor
from codex.pipeline.executor import Where, run_units, stage_pool


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

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        f"import sys; sys.path.insert(0, {root!r}); from tests.test_executor import _AtTeardown; "
        f"x = _AtTeardown({str(tmp_path / 'normal')!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert (tmp_path / "normal").exists()


def test_one_worker_runs_every_unit_here():
    got = [r for _, r in run_units(who, [1, 2], Where(workers=1))]
    assert {pid for _, pid in got} == {os.getpid()}
    assert executor.slots(Where(workers=3)) == 3  # units side by side: the driver counts
