"""The ground every layer stands on: the configuration (config/), file I/O over local paths and
gs:// (fsio.py), the run directory's folders (rundir.py), progress bars and logging (progress.py)
and the run lock (runlock.py).

Imports nothing of codex above it: model, pipeline, train, eval and cli all import it.
"""
