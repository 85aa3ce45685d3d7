"""codex: raw text to a trained, evaluated language model on Cloud TPUs or CUDA GPUs.

This package is the ground every stage stands on: the configuration (config/), file I/O over
local paths and gs:// (fsio.py), the run-directory contract (rundir.py), progress reporting
(progress.py) and the run lock (runlock.py). The stages live in pipeline/, model/, train/ and
eval/; the command line on top of all of them is codex/cli/, the one part of codex/ that imports
them.
"""

__version__ = "0.1.0"
