"""The planner decides each number once: a walk of train.batch_tokens from the command line to
the plan enters each module of train/plan once, in one direction; the steps and the learning rate
are defined in one place."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from click.testing import CliRunner

from codex.cli.main import cli

PLAN_DIR = Path(__file__).resolve().parents[3] / "train" / "plan"
# leaf arithmetic that memory.py and step_time.py both read (parameter counts, bytes per token),
# which imports nothing of the planner: the walk counts a call into it as its caller's arithmetic
LEAVES = {"params", "activations", "owners"}


def _module_walk(args: list[str]) -> tuple[list[str], str]:
    """The train/plan modules entered while `codex ARGS` runs, in order, each run of calls into
    one module counted once: a module entered is a call of one of its module-level functions from
    outside it (methods of the plan's dataclasses read data and are not counted)."""
    walk: list[str] = []

    def module_of(code) -> str | None:
        path = Path(code.co_filename).resolve()
        return path.stem if path.parent == PLAN_DIR else None

    def profile(frame, event, arg):
        if event != "call" or "." in frame.f_code.co_qualname:
            return
        mod = module_of(frame.f_code)
        if mod in LEAVES:
            return
        caller = frame.f_back
        if mod and (caller is None or module_of(caller.f_code) != mod):
            if not walk or walk[-1] != mod:
                walk.append(mod)

    sys.setprofile(profile)
    try:
        out = CliRunner().invoke(cli, args, terminal_width=200).output
    finally:
        sys.setprofile(None)
    return walk, out


def test_batch_tokens_walks_each_plan_module_once_in_one_direction():
    for hardware, extra in (("cpu", []), ("v6e-8", ["--model", "1b"]), ("h100-8", [])):
        args = ["train", "--hardware", hardware, *extra, "--batch-tokens", "8388608", "--help"]
        walk, out = _module_walk(args)
        assert "batch_tokens=8,388,608 a step" in out, out[-2000:]
        assert walk[:2] == ["report", "presets"], walk
        assert {"plan", "batch", "memory"} <= set(walk), walk
        twice = sorted({m for m in walk if walk.count(m) > 1})
        assert not twice, f"{hardware}: entered twice: {twice} in {walk}"


def test_the_walk_sees_a_module_entered_twice():
    """The check can fail: a walk that goes back to a module it left is caught."""
    from codex.train.plan import batch, presets

    def back_and_forth():
        presets.get_preset("cpu")
        batch.micro_batches(8, 1, 1, 1)
        presets.get_preset("cpu")

    walk: list[str] = []

    def profile(frame, event, arg):
        stem = Path(frame.f_code.co_filename).stem
        if event == "call" and Path(frame.f_code.co_filename).parent.name == "plan":
            if "." not in frame.f_code.co_qualname and (not walk or walk[-1] != stem):
                walk.append(stem)

    sys.setprofile(profile)
    try:
        back_and_forth()
    finally:
        sys.setprofile(None)
    assert [m for m in walk if m in ("presets", "batch")][:3] == ["presets", "batch", "presets"]


def _definitions(name: str) -> list[str]:
    """Where a function called `name` is defined in the packages."""
    roots = [Path(__file__).resolve().parents[3] / d for d in ("train", "eval", "pipeline")]
    roots.append(Path(__file__).resolve().parents[3] / "codex")
    found = []
    for root in roots:
        for f in root.rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    found.append(f"{f.relative_to(root.parent)}:{node.lineno}")
    return found


def _uses(pattern: str) -> list[str]:
    """Source lines of the packages that match regular expression `pattern`."""
    base = Path(__file__).resolve().parents[3]
    hits = []
    for d in ("train", "eval", "pipeline", "codex/cli", "codex/core"):
        for f in (base / d).rglob("*.py"):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if re.search(pattern, line):
                    hits.append(f"{f.relative_to(base)}:{i}")
    return hits


def test_steps_and_learning_rate_are_defined_once():
    assert _definitions("total_steps") == ["train/plan/plan.py:" + _line("def total_steps")]
    assert _definitions("learning_rate") == ["train/plan/plan.py:" + _line("def learning_rate")]
    # nothing else divides the token budget by the batch or reads the optimizer's default rate
    assert _uses(r"max_tokens\s*//?\s*\w*batch") == [
        "train/plan/plan.py:" + _line("math.ceil(t.max_tokens / batch_tokens)")
    ]
    assert _uses(r"DEFAULT_LR\[") == ["train/plan/plan.py:" + _line("DEFAULT_LR[t.optimizer]")]


def test_one_name_for_the_vocabulary_size():
    assert _uses("DEFAULT_VOCAB") == []
    assert _uses("32768") == [] and _uses("32_768") == [
        "codex/core/config/data.py:" + _line("vocab_size: int = setting(32_768", "data.py")
    ]


def _line(text: str, name: str = "plan.py") -> str:
    base = Path(__file__).resolve().parents[3]
    path = base / ("train/plan/plan.py" if name == "plan.py" else "codex/core/config/data.py")
    return str(next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line))
