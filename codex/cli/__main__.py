"""`python -m codex.cli ...` is `codex ...`: the entry for launchers such as torchrun.

    torchrun --nproc_per_node=8 -m codex.cli -- train --run runs/web --hardware h100-8 --model 124m
    torchrun --nnodes=2 --node_rank=R --master_addr=HOST --nproc_per_node=8 \\
        -m codex.cli -- train ...

`codex train --nproc-per-node N` runs the first line for you. These two are the only multi-process
launch lines. codex installs one top-level name, so a train.py (model.py, eval.py) in the working
directory, which `python -m` puts first on sys.path, is never imported in place of codex's own.

The `--` matters: without it torchrun's own parser reads `--run` as an abbreviation of its
`--run-path` option and stops. Every rank builds the same Config from the same flags. Exit 2 on a
configuration mistake, 0 on success and after a SIGTERM/SIGINT checkpoint.
"""

from __future__ import annotations

import sys

from codex.cli.main import cli


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    try:
        cli(args, prog_name="python -m codex.cli", standalone_mode=True)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
