"""What a command imports when it starts: `codex --help` none of the heavy or stage-specific
libraries, and `codex train` neither the tokenizer trainer (rustbpe) nor the .zst reader
(zstandard), so an accelerator image that has torch but not those runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.runs import base_overrides, child_env, make_run

HEAVY = ("torch", "ray", "rustbpe", "zstandard", "transformers", "lm_eval")

# A sitecustomize that makes the named libraries impossible to import, as on an image without them
# (None in sys.modules: `import` raises ImportError, importlib.util.find_spec answers None).
WITHOUT = """
import sys

for name in {names!r}:
    sys.modules[name] = None
"""


def imported(*args: str, cwd: Path) -> set[str]:
    """The top-level modules `python -X importtime -m codex.cli ARGS` imports."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "codex.cli", *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|")[-1] for line in run.stderr.splitlines() if "import time:" in line]
    return {r.strip().split(".")[0] for r in rows}


def test_help_imports_no_heavy_library(tmp_path):
    for args in (["--help"], ["data", "clean", "--help"], ["train", "--help"]):
        assert imported(*args, cwd=tmp_path).isdisjoint(HEAVY), args
    assert "codex" in imported("--help", cwd=tmp_path)  # the reading itself works


@pytest.mark.slow
def test_train_runs_without_rustbpe_and_zstandard(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(WITHOUT.format(names=("rustbpe", "zstandard")))
    env = child_env()
    env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    probe = subprocess.run(
        [sys.executable, "-c", "import zstandard"], env=env, capture_output=True, text=True
    )
    assert "ModuleNotFoundError: import of zstandard halted" in probe.stderr  # the removal works
    run = make_run(tmp_path / "run")
    flags = [f for o in base_overrides(max_steps=2) for f in ("--set", o)]
    trained = subprocess.run(
        [sys.executable, "-m", "codex.cli", "train", "--run", run, *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (Path(run) / "checkpoints" / "step_00000002" / "DONE").exists()
