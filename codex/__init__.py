"""codex: raw text to a trained, evaluated language model on Cloud TPUs or CUDA GPUs.

One import name holds it all, from the ground up:
- codex.core: configuration, file I/O, run directory, progress, run lock (codex/core/);
- codex.model, codex.pipeline, codex.train, codex.eval: the stages (the folders model/, pipeline/,
  train/ and eval/ at the top of the repository, mapped in);
- codex.cli: the command line, on top of everything (codex/cli/).
"""

__version__ = "0.1.0"
