"""Structure measures of the source tree, from the AST (no import of the project's code):

    python bench/structure.py

- import circles (file level) and arrows running back up (between folders, and between train's
  parts), by tests/fixtures/import_graph.py: both must be empty;
- for each part of train/ and pipeline/, the modules outside it that import it: who a change to
  that part's interface must touch;
- files, lines, lines over 100 characters, the longest files, functions over 6 parameters.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures.import_graph import (  # noqa: E402
    ROOT,
    cycles,
    import_graph,
    importers,
    module_files,
    upward_arrows,
)

PARTS = [
    "codex.train.optim",
    "codex.train.checkpoint",
    "codex.train.xla",
    "codex.train.xla.step",
    "codex.train.distributed",
    "codex.train.data",
    "codex.train.plan",
    "codex.pipeline.clean",
    "codex.pipeline.tokenizer",
    "codex.pipeline.shard",
    "codex.eval",
    "codex.core.config",
]


def main() -> None:
    graph = import_graph()
    files = module_files()
    print(f"modules: {len(files)}")
    print(f"import circles: {cycles(graph) or 'none'}")
    print(f"arrows running back up: {upward_arrows(graph) or 'none'}")
    print("\nimported from outside the part (a change to its interface touches these):")
    for part in PARTS:
        users = sorted(importers(graph, part))
        print(f"  {part:20s} {len(users):2d}  {', '.join(users)}")
    lines = {name: f.read_text().splitlines() for name, f in files.items()}
    total = sum(len(v) for v in lines.values())
    long_lines = sum(len(line) > 100 for v in lines.values() for line in v)
    print(f"\nlines: {total}, over 100 characters: {long_lines}")
    print(
        "longest files: "
        + ", ".join(
            f"{files[n].relative_to(ROOT)} {len(v)}"
            for n, v in sorted(lines.items(), key=lambda kv: -len(kv[1]))[:6]
        )
    )
    wide = []
    for name, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(
                    [
                        p
                        for p in a.posonlyargs + a.args + a.kwonlyargs
                        if p.arg not in ("self", "cls")
                    ]
                )
                if n > 6:
                    wide.append(f"{name}.{node.name} ({n})")
    print(f"functions over 6 parameters (each says why in its docstring): {len(wide)}")
    for w in wide:
        print(f"  {w}")


if __name__ == "__main__":
    main()
