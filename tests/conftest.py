"""Shared fixtures: a real GCS emulator, small corpora, and the XLA subprocess runner."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Tests never depend on the network or a wandb account.
os.environ.setdefault("WANDB_MODE", "offline")
# Training in the test process runs on one thread, as its child processes do (child_env), so the
# two compare bitwise; and no backend samples the machine's load for train.threads' default.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_SILENT", "true")
# gcsfs reads this at import: without it every bucket access waits 60 s on a gRPC probe the
# emulator cannot answer (NOTES.md section 4).
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_emulator():
    """A real gcp-storage-emulator on 127.0.0.1 for the whole session; yields its URL.

    Sets STORAGE_EMULATOR_HOST so codex.core.fsio (gcsfs) talks to it; the test makes its own bucket
    through `gcs_bucket`.
    """
    exe = shutil.which("gcp-storage-emulator") or str(
        Path(sys.executable).parent / "gcp-storage-emulator"
    )
    if not Path(exe).exists():
        pytest.fail("gcp-storage-emulator is not installed: pip install -e '.[dev]'")
    port = _free_port()
    # tests/gcs_emulator.py: the emulator, answering objects.move as real GCS does
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.gcs_emulator"]
        + ["start", "--host=127.0.0.1", f"--port={port}", "--in-memory"],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("GCS emulator did not start within 30 s")
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = url
    yield url
    if old is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = old
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def gcs_bucket(gcs_emulator):
    """A fresh bucket on the emulator; yields 'gs://NAME'."""
    import gcsfs

    name = f"codex-test-{uuid.uuid4().hex[:10]}"
    fs = gcsfs.GCSFileSystem(endpoint_url=gcs_emulator, token="anon")
    fs.mkdir(name)
    gcsfs.GCSFileSystem.clear_instance_cache()
    yield f"gs://{name}"


def run_xla(
    script: str, devices: int = 1, env: dict | None = None, timeout: int = 900
) -> subprocess.CompletedProcess:
    """Run `script` (Python source) in a fresh process on the XLA CPU backend with `devices`
    devices.

    The XLA runtime cannot be re-initialised inside one process, so every device count gets its own
    subprocess. Raises with the child's output when it fails.
    """
    full_env = dict(os.environ)
    full_env.update(
        {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "PYTHONPATH": str(ROOT)}
    )
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"XLA subprocess failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-8000:]}"
        )
    return proc


def _nodes_alive(address: str, nodes: int, timeout: float = 120.0) -> None:
    """Wait until the cluster at `address` has `nodes` nodes alive (this process attaches as a
    Ray driver for that, then detaches)."""
    import ray

    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout
        alive = 0
        while alive < nodes and time.monotonic() < deadline:
            alive = sum(bool(n.get("Alive")) for n in ray.nodes())
            time.sleep(0.2)
        assert alive == nodes, f"the Ray cluster has {alive} of {nodes} nodes alive"
    finally:
        ray.shutdown()


# The second node's first Python worker takes 5 s more to start, as on a cold machine (CI): a
# driver that gave the cluster its units before every node had a worker would run short units all
# on the head (pipeline/executor/ray_cluster.py: _a_worker_on_every_node).
_COLD_FIRST_WORKER = """import os, sys, time
flag = os.path.join(os.path.dirname(__file__), "started")
worker = any(a.endswith("default_worker.py") for a in getattr(sys, "argv", []))
if worker and not os.path.exists(flag):
    open(flag, "w").close()
    time.sleep(5)
"""

RAY_EXE = Path(sys.executable).parent / "ray"


def _sessions() -> dict[int, list[tuple[int, int]]]:
    """Every process on the machine by its session id: [(pid, process group)], zombies left out."""
    found: dict[int, list[tuple[int, int]]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        state, pgid, sid = fields[0], int(fields[2]), int(fields[3])
        if state != "Z":
            found.setdefault(sid, []).append((int(entry.name), pgid))
    return found


class RayCluster:
    """A Ray cluster on this machine, started and ended by its own processes: every node is a
    `ray start` in a session (and process group) of its own (setsid), and stop() kills those
    sessions' processes: the node's daemons, in the node's group, and its workers, in groups of
    their own inside the node's session. Never `ray stop`: it ends every Ray process on the
    machine, other people's clusters and test runs included (NOTES.md section 7)."""

    def __init__(self, port: int, temp: str):
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.temp = temp
        self.sessions: list[int] = []  # one a node, the head's first

    @classmethod
    def start(cls, nodes: int = 2, cold_second: bool = False, prefix: str = "ray") -> RayCluster:
        """`nodes` nodes (a raylet each) of 1 CPU each; cold_second: the second node's first
        worker starts 5 s late. Raises RuntimeError with Ray's last line, after ending what it
        started, when a node cannot start."""
        # short: Ray's Unix socket paths are limited
        cluster = cls(_free_port(), tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        # A head started by `ray start` turns on token authentication (Ray >= 2.5x) unless told
        # not to; a throwaway cluster on 127.0.0.1 needs none, and its nodes and driver agree.
        os.environ["RAY_AUTH_MODE"] = "disabled"
        cold = Path(cluster.temp) / "cold"
        cold.mkdir()
        (cold / "sitecustomize.py").write_text(_COLD_FIRST_WORKER)
        for i in range(nodes):
            cluster.add_node(cold=cold_second and i == 1)
        return cluster

    def add_node(self, cold: bool = False) -> None:
        """Start one more node of 1 CPU (the first one: the head); cold: its first worker starts
        5 s late. Raises RuntimeError with Ray's last line, after ending the whole cluster, when
        it cannot start."""
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        common = ["--num-cpus", "1", "--object-store-memory", str(200 << 20)]
        common += ["--disable-usage-stats"]
        if self.sessions:
            args = ["--address", self.address]
        else:
            args = ["--head", "--port", str(self.port), "--temp-dir", self.temp]
            args += ["--include-dashboard=false", "--ray-client-server-port", str(_free_port())]
        if cold:
            path = [str(Path(self.temp) / "cold"), os.environ.get("PYTHONPATH")]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        proc = subprocess.Popen(
            [str(RAY_EXE), "start", *args, *common],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its daemons stay in this session and group
        )
        self.sessions.append(proc.pid)
        try:
            out, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            out = "`ray start` took over 180 s"
        if proc.returncode:
            self.stop()
            last = out.strip().splitlines()[-1:]
            raise RuntimeError(f"ray start (node {len(self.sessions) - 1}): {' '.join(last)}")

    def processes(self) -> list[int]:
        """The cluster's live processes (pids)."""
        found = _sessions()
        return [pid for sid in self.sessions for pid, _ in found.get(sid, [])]

    def kill(self, node: int = 0) -> None:
        """SIGKILL one node's processes (0: the head: its GCS, raylet and workers)."""
        sid = self.sessions[node]
        for pgid in {pgid for _, pgid in _sessions().get(sid, [])}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)

    def stop(self, timeout: float = 30.0) -> None:
        """Kill every node's processes and wait until none is left; remove its temp dir."""
        deadline = time.monotonic() + timeout
        while True:
            for node in range(len(self.sessions)):
                self.kill(node)
            if not self.processes() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        shutil.rmtree(self.temp, ignore_errors=True)

    def answers(self) -> bool:
        """Whether the head's GCS port accepts a connection."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2):
                return True
        except OSError:
            return False


@pytest.fixture(scope="session")
def ray_cluster(gcs_emulator):
    """A real two-node Ray cluster on this machine: `ray start --head` and a second `ray start`,
    two raylets of 1 CPU each (NOTES.md section 7), the second one slow to start its first
    worker; yields the address. Its workers see the GCS emulator (they inherit
    STORAGE_EMULATOR_HOST from here). Ended by its own processes (RayCluster.stop), never
    `ray stop`. Skips, saying why, only where Ray is not installed or cannot start."""
    if not RAY_EXE.exists():
        pytest.skip("Ray is not installed in this venv: pip install -e '.[ray]'")
    try:
        cluster = RayCluster.start(nodes=2, cold_second=True)
    except RuntimeError as e:
        pytest.skip(f"Ray cannot start a cluster here: {e}")
    try:
        _nodes_alive(cluster.address, nodes=2)
        yield cluster.address
    finally:
        cluster.stop()


def _ray_attached() -> bool:
    ray = sys.modules.get("ray")
    is_initialized = getattr(ray, "is_initialized", None)
    return bool(is_initialized and is_initialized())


@pytest.fixture(autouse=True)
def _no_ray_driver_left_attached():
    """No Ray runtime stays attached to the test process after a test: a stage detaches the
    driver it attached (pipeline/executor/ray_cluster.py: detach_ray). An attached driver ties the
    whole test process to its cluster: when the cluster's processes end, Ray's core worker ends
    this process, status 1 and no word, a minute later."""
    yield
    if _ray_attached():
        import ray

        ray.shutdown()
        pytest.fail("a Ray driver was left attached to the test process after the test")


@pytest.fixture(autouse=True)
def _no_log_file_left_open():
    """A command run in-process (CliRunner) logs to its RUN/logs/<command>.log until the process
    ends: closed after each test, so no later test's lines go there."""
    yield
    from codex.core import progress

    progress.close_log_file()
