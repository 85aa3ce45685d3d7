"""The command line, on top of everything: `codex` (main.py: every command), how a command is
built (command.py: config options, one-line errors and exit codes, the run lock), the demo
(demo.py), and `python -m codex.cli` for launchers such as torchrun (__main__.py).

Imports every other package; nothing imports it.
"""


def main() -> None:
    """The `codex` console script (pyproject's [project.scripts]). The commands are imported when
    it runs, not by the script's own import line: spawn starts a data stage's worker process by
    running a script `__main__` again (as `__mp_main__`, its `if __name__` block skipped), and
    the script's imports would load the whole command line in every worker for nothing."""
    from codex.cli.main import main as run

    run()
