"""The command line, on top of everything: `codex` (main.py: every command), how a command is
built (command.py: config options, one-line errors and exit codes, the run lock), the demo
(demo.py), and `python -m codex.cli` for launchers such as torchrun (__main__.py).

Imports every other package; nothing imports it.
"""
