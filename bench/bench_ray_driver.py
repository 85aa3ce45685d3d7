"""The Ray driver's rate and cost per finished unit as the tasks in flight grow: old (a unit a
task, each task's future calling back into a queue) against new (several short units a task:
ray_tasks._Batches), and the older ray.wait over every task in flight for each finished unit.

    python bench/bench_ray_driver.py                                  # 1k, 4k, 16k, 64k in flight
    python bench/bench_ray_driver.py --in-flight 1000 4000 --units 2000 --seconds 10   # quicker

One local Ray node is started here (`ray start --head` on free ports, RAY_AUTH_MODE=disabled, in a
session of its own, ended by killing that session's processes; never `ray stop`: it ends every Ray
process on the machine) with --cpus logical CPUs, so that the driver's in-flight limit is as a big
cluster's. Each unit's task also reserves 1/--slots of the node's memory (data.task.memory_gb's
reservation), so only --slots run at once: a node with 32,000 free CPUs would otherwise start a
Python worker per task it can place, which this machine cannot hold.

For each in-flight count L and each mode, run_units runs no-op units with the in-flight limit set
to L tasks (the real run_ray: batching, submission, _Limit, head watch, results). The units wait
at a gate until the driver has submitted all L tasks; measured from then over the next --units
finished units or --seconds, whichever comes first: units a second, and the driver's CPU per
unit (time.process_time: its Python and Ray's threads in it).
Modes: old = a unit a task (ray_tasks.MAX_BATCH 1), futures (ray_tasks._Finished); new = the
executor's batches (enough units that the batches are not cut by what is left); wait = the
ray.wait over every task in flight the driver called per unit before that; fraction = a ray.wait
for 1/8 of those in flight with a 0.1 s timeout. Each measurement runs in a driver process of its
own (its job's workers started by 500 units first), which exits with its units in flight.
"start s" is submitting the L tasks; "units/task" the mean batch handed out. The 1-minute load
average is printed with each row: this machine may be shared.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codex.pipeline import executor  # noqa: E402
from codex.pipeline.executor import ray_cluster, ray_tasks  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")
TASK_MEMORY = 64 << 20
WARM_UNITS = 500  # run before each measurement, so that its workers are up
_LEFT_OPEN: list = []  # the measured runs, open until the process exits


def noop_unit(unit: int) -> int:
    return unit


class WaitEach:
    """The driver's old way: for each finished unit, a ray.wait over every task in flight."""

    def __init__(self, ray, watch):
        self.ray, self.watch = ray, watch

    def add(self, ref) -> None:
        pass

    def take(self, running: dict, timeout: float) -> list:
        done = ray_cluster.wait(self.ray, list(running), 1, timeout, self.watch)
        return [(ref, functools.partial(self.ray.get, ref)) for ref in done]


class WaitFraction(WaitEach):
    """A ray.wait for 1/8 of the tasks in flight, or what finished within 0.1 s: one scan of
    every task in flight shared by the units that finished meanwhile."""

    def take(self, running: dict, timeout: float) -> list:
        refs = list(running)
        done, _ = self.ray.wait(refs, num_returns=max(1, len(refs) // 8), timeout=0.1)
        self.watch.check()
        return [(ref, functools.partial(self.ray.get, ref)) for ref in done]


MODES = {
    "old": ray_tasks._Finished,
    "new": ray_tasks._Finished,
    "wait": WaitEach,
    "fraction": WaitFraction,
}


class Counted(ray_tasks._Batches):
    """The executor's batches, counted: tasks and units handed out."""

    tasks = units = 0

    def take(self, limit: int) -> list:
        batch = super().take(limit)
        Counted.tasks += 1
        Counted.units += len(batch)
        return batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(cpus: int, slots: int) -> tuple[str, int, str]:
    """A Ray head of `cpus` logical CPUs and memory for `slots` units at once: (its address, its
    session id, its temp dir)."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rayd", dir="/tmp")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # idle workers above this are ended: the node keeps about --slots of them
    env["RAY_num_workers_soft_limit"] = str(slots + 2)
    cmd = [RAY, "start", "--head", "--port", str(port), "--temp-dir", temp]
    cmd += ["--num-cpus", str(cpus), "--memory", str(slots * TASK_MEMORY)]
    cmd += ["--object-store-memory", str(300 << 20), "--include-dashboard=false"]
    cmd += ["--ray-client-server-port", str(free_port()), "--disable-usage-stats"]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    if proc.returncode:
        stop_node(proc.pid, temp)
        raise SystemExit(f"ray start failed: {out.strip().splitlines()[-1:]}")
    return f"127.0.0.1:{port}", proc.pid, temp


def stop_node(sid: int, temp: str) -> None:
    """Kill every process of the node's session (its daemons and workers), nobody else's."""
    for _ in range(50):
        out = subprocess.run(["ps", "-eo", "pid,sid"], capture_output=True, text=True).stdout
        pids = [int(p) for p, s in (ln.split() for ln in out.splitlines()[1:]) if int(s) == sid]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    subprocess.run(["rm", "-rf", temp], check=False)


def gated_unit(gate: str, unit: int) -> int:
    """A no-op unit that waits until `gate` exists (the driver has submitted every unit in
    flight)."""
    while not os.path.exists(gate):
        time.sleep(0.01)
    return unit


def gated(mode: type, in_flight: int, full: Callable[[], None]) -> type:
    """mode's class, calling full() once the driver has submitted in_flight units."""

    class Gated(mode):  # type: ignore[misc,valid-type]
        submitted = 0

        def add(self, ref) -> None:
            super().add(ref)
            Gated.submitted += 1
            if Gated.submitted == in_flight:
                full()

    return Gated


def measure(address: str, in_flight: int, mode: str, units: int, seconds: float) -> dict:
    """One run_units over in_flight + units no-op units, in_flight of them in flight: the rate and
    the driver's CPU per unit over `units` finished units (or `seconds`). The units wait at a
    gate until all in_flight are submitted: the clock starts then, with none finished, so no
    backlog of units finished meanwhile is counted as done in the window."""
    ray_tasks.in_flight_limit = lambda cpus, pending: in_flight
    if mode != "new":
        ray_tasks.MAX_BATCH = 1  # a unit a task
    ray_tasks._Batches = Counted  # type: ignore[misc]
    policy = executor.TaskPolicy(memory_bytes=TASK_MEMORY, ray_pending=0)
    where = executor.Where("ray", 1, address, policy)
    # the job's workers started first (a new driver's job gets new ones): a stage keeps the driver
    # attached from this run to the measured one
    stage = executor.stage_pool(where)
    where = stage.__enter__()
    for _ in executor.run_units(noop_unit, list(range(WARM_UNITS)), where):
        pass
    Counted.tasks = Counted.units = 0
    gate = tempfile.mktemp(prefix="codex-bench-gate-")
    started: dict[str, float] = {}

    def full() -> None:
        started.update(t=time.monotonic(), cpu=time.process_time())
        open(gate, "w").close()

    ray_tasks._Finished = gated(MODES[mode], in_flight, full)  # type: ignore[misc]
    t_start = time.monotonic()
    n = 0
    try:
        fn = functools.partial(gated_unit, gate)
        # the new mode's first batches are FIRST_BATCH units, when SHARES x as many are left
        per_task = ray_tasks.SHARES * ray_tasks.FIRST_BATCH if mode == "new" else 1
        run = executor.run_units(fn, range(in_flight * per_task + units + 1), where)
        _LEFT_OPEN.append(run)  # never closed: closing it would cancel the units in flight
        for _ in run:
            n += 1
            if n >= units or time.monotonic() - started["t"] >= seconds:
                break
    finally:
        with contextlib.suppress(OSError):
            os.unlink(gate)
    wall, cpu = time.monotonic() - started["t"], time.process_time() - started["cpu"]
    return {
        "in_flight": in_flight,
        "mode": mode,
        "units": n,
        "units_per_s": n / wall,
        "driver_cpu_us_per_unit": cpu / n * 1e6,
        "start_s": started["t"] - t_start,
        "units_per_task": Counted.units / max(1, Counted.tasks),
        "load_1min": os.getloadavg()[0],
    }


def measure_in_a_process(address: str, in_flight: int, mode: str, units: int, seconds: float):
    """measure() in a driver process of its own, which then exits with its units in flight: Ray
    drops a dead driver's tasks. Ending them from the driver instead (ray.cancel, ray.shutdown)
    with thousands in flight can end Ray 2.60's driver process itself ("Tried to complete task
    that was not pending", "the local Raylet is dead"), the row unprinted."""
    args = [address, str(in_flight), mode, str(units), str(seconds)]
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, __file__, "--one", *args], capture_output=True, text=True, timeout=1800
    )
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not rows:
        raise SystemExit(f"{mode} at {in_flight} in flight: exit {proc.returncode}\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")  # fmt: skip
    row = json.loads(rows[-1])
    row["process_s"] = time.monotonic() - t0
    return row


def main() -> None:
    if sys.argv[1:2] == ["--one"]:  # one measurement, in this process (measure_in_a_process)
        address, in_flight, mode, units, seconds = sys.argv[2:7]
        logging.basicConfig(level=logging.WARNING)
        row = measure(address, int(in_flight), mode, int(units), float(seconds))
        print(json.dumps(row), flush=True)
        os._exit(0)  # its units in flight go with it
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", type=int, default=32000, help="the node's logical CPUs")
    ap.add_argument("--slots", type=int, default=4, help="units that run at once")
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1000, 4000, 16000, 64000])
    ap.add_argument("--modes", nargs="+", default=["old", "new"], choices=MODES)
    ap.add_argument("--units", type=int, default=5000, help="finished units measured, at most")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds measured, at most")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    print(f"load average before: {os.getloadavg()}", flush=True)
    address, sid, temp = start_node(args.cpus, args.slots)
    rows = []
    try:
        print(f"{'in flight':>9} {'mode':>8} {'units':>6} {'units/s':>8} "
              f"{'CPU us/unit':>11} {'start s':>7} {'units/task':>10} {'load':>5}")  # fmt: skip
        for in_flight in args.in_flight:
            for mode in args.modes:
                r = measure_in_a_process(address, in_flight, mode, args.units, args.seconds)
                rows.append(r)
                print(
                    f"{in_flight:>9} {mode:>8} {r['units']:>6} {r['units_per_s']:>8.0f} "
                    f"{r['driver_cpu_us_per_unit']:>11.0f} {r['start_s']:>7.1f} "
                    f"{r['units_per_task']:>10.1f} {r['load_1min']:>5.1f}",
                    flush=True,
                )
    finally:
        stop_node(sid, temp)
    for mode in args.modes:
        cpu = [r["driver_cpu_us_per_unit"] for r in rows if r["mode"] == mode]
        if len(cpu) > 1:
            print(
                f"{mode}: CPU a unit at the most in flight / at the fewest: {cpu[-1] / cpu[0]:.2f}x"
            )
    print(f"load average after: {os.getloadavg()}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
