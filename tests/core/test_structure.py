"""The layout holds: no import circle, no arrow running back up, ARCHITECTURE.md names every source
file (and only files that exist), every part of train/ and pipeline/ says what it owns, and no
function takes more than 6 parameters without saying why."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.import_graph import (
    LAYERS,
    ROOT,
    STAGES,
    TRAIN_LAYERS,
    cycles,
    folder,
    import_graph,
    module_files,
    upward_arrows,
)

MAX_PARAMETERS = 6


def test_no_import_circle():
    assert cycles(import_graph()) == []


@pytest.mark.slow
def test_no_arrow_runs_back_up():
    assert upward_arrows(import_graph()) == []


def test_the_graph_sees_lazy_imports_and_the_rules_can_fail(tmp_path):
    """A circle made only of imports inside functions, and an arrow from the ground (codex.core)
    up to train, are both caught: the checks above are not vacuous."""
    for pkg in ("codex", "codex/core", "model", "pipeline", "train", "eval"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "train" / "loop.py").write_text("def f():\n    from codex.train import data\n")
    (tmp_path / "train" / "data.py").write_text("def g():\n    import codex.train.loop\n")
    (tmp_path / "codex" / "core" / "fsio.py").write_text("from codex.train.loop import f\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["codex.train.data", "codex.train.loop"]]
    assert upward_arrows(graph) == [
        ("codex.core.fsio", "codex.train.loop"),
        ("codex.train.data", "codex.train.loop"),
    ]


def test_layers_name_every_folder_and_train_part():
    layers = {folder(m) for m in module_files()}
    assert layers == set(LAYERS)
    parts = {p.name.removesuffix(".py") for p in (ROOT / "train").iterdir()}
    parts -= {"__init__", "__pycache__"}
    assert parts == set(TRAIN_LAYERS)


def test_one_import_namespace_and_no_folder_named_dist():
    """Every module is codex.*, each stage folder is linked into codex/ (so a checkout imports
    what the wheel installs), and no folder is named dist (tools skip such folders unasked)."""
    assert all(m == "codex" or m.startswith("codex.") for m in module_files())
    for stage in (*STAGES, "configs"):
        link = ROOT / "codex" / stage
        assert link.is_symlink() and link.resolve() == (ROOT / stage).resolve(), link
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    assert not [f for f in tracked if "dist" in Path(f).parent.parts]


def architecture_names(text: str) -> set[str]:
    """Every project path ARCHITECTURE.md names: written out (`train/loop.py`), or as a file
    name in a row of the map whose first cell is its folder (| `train/xla/` | `step.py` ...)."""
    top = r"(?:codex|pipeline|model|train|eval|bench|tests)"
    named = set(re.findall(rf"\b({top}/[\w/]*\w(?:\.py)?)", text))
    for row in re.finditer(rf"^\| `({top}/(?:[\w]+/)*)` \|(.*)$", text, re.M):
        named |= {row.group(1) + name for name in re.findall(r"`(\w+\.py)`", row.group(2))}
    return named


def test_architecture_names_every_source_file_and_only_files_that_exist():
    named = architecture_names((ROOT / "ARCHITECTURE.md").read_text())
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"
    sources = {str(f.relative_to(ROOT)) for f in module_files().values() if f.name != "__init__.py"}
    unnamed = sorted(sources - named)
    assert not unnamed, f"ARCHITECTURE.md does not name: {unnamed}"


def test_architecture_names_only_symbols_that_exist_where_it_says():
    """`train/checkpoint/state.py: save_training` (or `file.py` (`name`)) names a function, class
    or attribute defined in that file."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    top = r"(?:codex|pipeline|model|train|eval)"
    pairs = re.findall(rf"({top}/[\w/]+\.py)`?(?:: |`? \(`)`?([A-Za-z_][\w.]*)", text)
    assert len(pairs) > 20
    wrong = []
    for path, symbol in pairs:
        name = symbol.split(".")[-1]
        src = (ROOT / path).read_text()
        pattern = rf"(def|class) {name}\b|^\s*{name}\s*[:=]|self\.{name}\s*[:=]"
        if not re.search(pattern, src, re.M):
            wrong.append(f"{path}: {symbol}")
    assert not wrong, f"ARCHITECTURE.md names symbols that are not there: {wrong}"


def test_pyproject_ships_every_package():
    """pyproject.toml names its packages one by one (it also maps configs/ into the wheel): a new
    folder left off the list would be missing from the wheel."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {m for m, f in module_files().items() if f.name == "__init__.py"}
    assert all(p == "codex" or p.startswith("codex.") for p in listed)
    assert listed == packages | {"codex.configs"}


def test_every_part_says_what_it_owns():
    for init in sorted(
        list((ROOT / "train").glob("*/__init__.py"))
        + list((ROOT / "pipeline").glob("*/__init__.py"))
    ):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "Imports" in doc, f"{init.relative_to(ROOT)}: say what it owns and imports"


def _functions():
    """(module name, function node, its docstring) for every function of the packages."""
    for name, f in module_files().items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node, ast.get_docstring(node) or ""


def test_no_function_takes_more_than_six_parameters_without_a_reason():
    """A function over the limit says why in its docstring, as 'N parameters: <reason>'."""
    offenders = []
    for name, node, doc in _functions():
        a = node.args
        params = [p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
        if len(params) > MAX_PARAMETERS and f"{len(params)} parameters:" not in doc:
            offenders.append(f"{name}.{node.name} ({len(params)})")
    assert not offenders, offenders


MAX_FUNCTION_LINES = 80


def test_no_function_runs_over_eighty_lines_without_a_reason():
    """A longer function says why in its docstring, in one line starting 'Long: '."""
    offenders = [
        f"{name}.{node.name} ({length} lines)"
        for name, node, doc in _functions()
        if (length := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
        and "Long: " not in doc
    ]
    assert not offenders, offenders


MAX_MODULE_LINES = 600


def test_no_module_runs_over_six_hundred_lines():
    """A module past the limit holds more than one concept: cut it along its seams."""
    offenders = [
        f"{name} ({n})"
        for name, f in module_files().items()
        if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not offenders, offenders


MAX_MODULE_DOCSTRING_LINES = 13


def test_module_docstrings_are_a_few_lines():
    """A module says what it is and why in a few lines; the long explanations live in docs/."""
    offenders = []
    for name, f in module_files().items():
        doc = ast.get_docstring(ast.parse(f.read_text())) or ""
        if len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            offenders.append(f"{name} ({len(doc.splitlines())} lines)")
    assert not offenders, offenders
