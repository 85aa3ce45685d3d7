"""Shared fixtures: a real GCS emulator, a finished tiny run (built once a session), small corpora,
and the XLA subprocess runner."""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest

from tests.fixtures.procs import (  # noqa: F401
    COLD_FIRST_WORKER,
    RAY_EXE,
    RayCluster,
    free_port,
    nodes_alive,
    run_xla,
    sessions,
)

ROOT = Path(__file__).resolve().parent.parent

# Tests never depend on the network or a wandb account.
os.environ.setdefault("WANDB_MODE", "offline")
# Training in the test process runs on one thread, as its child processes do (child_env), so the
# two compare bitwise; and no backend samples the machine's load for train.threads' default.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_SILENT", "true")
# gcsfs reads this at import: without it every bucket access waits 60 s on a gRPC probe the
# emulator cannot answer.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


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
    from tests.fixtures.gcs_emulator import Emulator

    # tests/fixtures/gcs_emulator.py: the emulator, answering objects.move as real GCS does
    try:
        emulator = Emulator(None).start()
    except RuntimeError as e:
        pytest.fail(str(e))
    url = emulator.url
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = url
    yield url
    if old is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = old
    emulator.stop()


@pytest.fixture
def own_gcs_emulator(tmp_path, monkeypatch):
    """A GCS emulator of the test's own (tests/fixtures/gcs_emulator.py: Emulator), to kill and
    restart on its port: its objects on disk, they outlive a restart. STORAGE_EMULATOR_HOST
    points at it for the test."""
    from tests.fixtures.gcs_emulator import Emulator

    emulator = Emulator(tmp_path / "gcs").start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
    yield emulator
    emulator.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator):
    """A fresh bucket on the emulator; yields 'gs://NAME'."""
    import gcsfs

    name = f"codex-test-{uuid.uuid4().hex[:10]}"
    fs = gcsfs.GCSFileSystem(endpoint_url=gcs_emulator, token="anon")
    fs.mkdir(name)
    gcsfs.GCSFileSystem.clear_instance_cache()
    yield f"gs://{name}"


@pytest.fixture(scope="session")
def base_run(tmp_path_factory) -> Path:
    """A finished tiny run made with the real CLI (tests/fixtures/bad_input.py:
    build_finished_run), built once for the session on first use; never changed: a test that
    changes a run takes `run`."""
    from tests.fixtures.bad_input import build_finished_run

    return build_finished_run(tmp_path_factory.mktemp("finished_run"))


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    """A private copy of the finished run (cases may damage it)."""
    dst = tmp_path / "run"
    shutil.copytree(base_run, dst)
    return dst


@pytest.fixture(scope="session")
def ray_cluster(gcs_emulator):
    """A real two-node Ray cluster on this machine: `ray start --head` and a second `ray start`,
    two raylets of 1 CPU each, the second one slow to start its first
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
        nodes_alive(cluster.address, nodes=2)
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


def pytest_collection_modifyitems(items):
    """A test on the Ray cluster is slow whatever it measures: the cluster takes seconds to start,
    and `make test-fast` never starts one."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
