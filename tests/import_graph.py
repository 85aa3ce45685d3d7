"""The project's import graph, read from the source (AST), and the layering it must keep.

Every `import` and `from ... import` counts, at module level or inside a function: a lazy import
is still an arrow. Used by tests/test_structure.py (the rules) and bench/structure.py (the report).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The one import namespace, `codex`, and the folder each of its stage packages lives in (the
# wheel maps them in; in a checkout codex/<name> is a link to the top-level folder).
STAGES = ("model", "pipeline", "train", "eval")

# Layers from the ground up: an arrow may only point to the same layer or one listed earlier.
# codex.core is the ground (config, I/O, progress, run lock); codex.cli sits on top of all.
LAYERS = ("codex.core", "codex.model", "codex.pipeline", "codex.train", "codex.eval", "codex.cli")

# train/'s parts from the bottom up, by the same rule.
TRAIN_LAYERS = (
    "data",
    "plan",
    "optim",
    "distributed",
    "xla",
    "checkpoint",
    "metrics",
    "remat",
    "launch",
    "compile_only",
    "loop",
)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} for every source file of the project, each file once (the
    links under codex/ are not followed; the stage folders are read where they really are)."""
    mods = {}
    folders = [(root / "codex", ())] + [(root / s, ("codex", s)) for s in STAGES]
    for top, prefix in folders:
        for f in sorted(top.rglob("*.py")):
            rel = f.relative_to(top).with_suffix("").parts
            if top.name == "codex" and (top / rel[0]).is_symlink():
                continue
            name = ".".join((*(prefix or ("codex",)), *rel))
            mods[name.removesuffix(".__init__")] = f
    return mods


def _imported(node: ast.AST, name: str, is_package: bool) -> list[str]:
    """The dotted names one import statement may refer to (a module, or a name inside one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = name.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [module] + [f"{module}.{a.name}" for a in node.names]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the project modules it imports}."""
    mods = module_files(root)
    graph: dict[str, set[str]] = defaultdict(set)
    for name, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            for target in _imported(node, name, f.name == "__init__.py"):
                if target in mods and target != name:
                    graph[name].add(target)
    return {m: set(graph.get(m, ())) for m in mods}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), i.e. every import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def folder(module: str) -> str:
    """The layer a module belongs to: codex.cli.* the top, codex.train.* train's, ...; the root
    package `codex` (its version only) counts as the ground."""
    parts = module.split(".")
    return "codex.core" if len(parts) == 1 else ".".join(parts[:2])


def train_part(module: str) -> str | None:
    """codex.train.distributed.backend -> 'distributed', codex.train.loop -> 'loop'; None outside
    train/ and for train/ itself."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["codex", "train"] and len(parts) > 2 else None


def upward_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import from a lower layer to a higher one: between folders, between train's parts."""
    bad = []
    for a, targets in graph.items():
        for b in targets:
            fa, fb = folder(a), folder(b)
            if fa != fb and LAYERS.index(fa) < LAYERS.index(fb):
                bad.append((a, b))
            pa, pb = train_part(a), train_part(b)
            if pa and pb and pa != pb and TRAIN_LAYERS.index(pa) < TRAIN_LAYERS.index(pb):
                bad.append((a, b))
    return sorted(bad)


def importers(graph: dict[str, set[str]], package: str) -> set[str]:
    """The modules outside `package` (a dotted prefix) that import something inside it."""

    def inside(m: str) -> bool:
        return m == package or m.startswith(package + ".")

    return {a for a, targets in graph.items() if not inside(a) and any(inside(b) for b in targets)}
