"""codex as a user installs it: the wheel, unpacked outside the checkout and run from another
folder, finds its presets (configs/ ships inside it) and trains."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.runs import base_overrides, child_env, make_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the tracked files (a build in the checkout would
    reuse its build/ folder) and installed without dependencies into a folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    src = tmp / "src"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp / "dist").glob("codex-*.whl")
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target"]
    subprocess.run([*install, str(tmp / "site"), str(wheel)], check=True, capture_output=True)
    return tmp / "site"


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = child_env()
    env["PYTHONPATH"] = str(site)  # the wheel's copy, ahead of the checkout's editable install
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_name(installed):
    (top,) = installed.glob("codex-*.dist-info/top_level.txt")
    assert top.read_text().split() == ["codex"]
    assert sorted(p.name for p in installed.iterdir() if not p.name.endswith(".dist-info")) == [
        "bin",
        "codex",
    ]


@pytest.mark.slow
def test_the_wheel_runs_outside_the_checkout(installed, tmp_path):
    where = run_installed(
        installed,
        tmp_path,
        "-c",
        "import codex, codex.train, codex.pipeline, codex.core.config as c; "
        "print(codex.__file__, codex.train.__file__, c.CONFIGS_DIR)",
    )
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(str(installed)) for p in where.stdout.split()), where.stdout
    # clean's compiled word counter ships in the wheel wherever the checkout's install built it
    from codex.pipeline.clean import words

    built = run_installed(
        installed, tmp_path, "-c", "from codex.pipeline.clean import words as W; print(W.COUNTER)"
    )
    assert built.returncode == 0, built.stderr
    assert ("Counter" in built.stdout) == (words.COUNTER is not None), built.stdout
    # spaCy's tables for the word splitter ship as package data (pipeline/clean/spacy_en.json)
    tables = run_installed(
        installed,
        tmp_path,
        "-c",
        "from codex.pipeline.clean import spacy_en as S; print(S.__file__, len(S.SPECIAL_CASES))",
    )
    assert tables.returncode == 0, tables.stderr
    path, cases = tables.stdout.split()
    assert path.startswith(str(installed)) and int(cases) == len(words.SPECIAL_CASES), tables.stdout

    # a user's folder with its own train.py, model.py, eval.py and pipeline.py (a nanoGPT
    # checkout): codex must never import them in place of its packages
    user = tmp_path / "user"
    user.mkdir()
    for name in ("train.py", "model.py", "eval.py", "pipeline.py"):
        (user / name).write_text(f"raise SystemExit('the user\\'s {name} was imported')\n")

    table = run_installed(installed, user, "-m", "codex.cli", "hardware")
    assert table.returncode == 0 and "v6e-4" in table.stdout, table.stderr
    script = [str(installed / "bin" / "codex"), "hardware", "--model", "124m"]
    fit = run_installed(installed, user, *script)
    assert fit.returncode == 0, fit.stderr
    assert "model 124m: 135M parameters" in fit.stdout and "v6e-4" in fit.stdout

    # the python -c line a notebook or a user's script runs: the working folder first on the path
    run0 = make_run(tmp_path / "run0")
    flags0 = [f for o in base_overrides(max_steps=2) for f in ("--set", o)]
    argv = ["train", "--run", run0, *flags0]
    inline = run_installed(
        installed,
        user,
        "-c",
        f"import sys; from codex.cli import main; sys.argv = ['codex', *{argv!r}]; main()",
    )
    assert inline.returncode == 0, inline.stderr[-3000:]
    assert (Path(run0) / "checkpoints" / "step_00000002" / "DONE").exists()

    run = make_run(tmp_path / "run")
    flags = [f for o in base_overrides(max_steps=2) for f in ("--set", o)]
    trained = run_installed(installed, user, "-m", "codex.cli", "train", "--run", run, *flags)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (Path(run) / "checkpoints" / "step_00000002" / "DONE").exists()

    # several processes through codex: torchrun started by `codex train --nproc-per-node 2`
    run2 = make_run(tmp_path / "run2")
    two = run_installed(
        installed, user, "-m", "codex.cli", "train", "--run", run2, *flags, "--nproc-per-node", "2"
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 processes" in two.stderr or "world 2" in two.stderr or "x2" in two.stderr, two.stderr[
        -3000:
    ]
    assert (Path(run2) / "checkpoints" / "step_00000002" / "DONE").exists()
