"""codex: raw text to a trained, evaluated language model on Cloud TPUs or CUDA GPUs.

This package holds the command line and what every stage shares: configuration (config.py),
file I/O over local paths and gs:// (fsio.py), the run-directory contract (rundir.py) and
progress reporting (progress.py). The stages live in pipeline/, model/, train/ and eval/.
"""

__version__ = "0.1.0"
