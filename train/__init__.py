"""Training: `train(cfg, evaluate)` in loop.py, read top to bottom.

    loop.py        the loop: plan, model, optimizer, loader, resume, the step, log/validate/save
    launch.py      open_backend: the preset's backend (CPU/CUDA in dist/, TPU in xla/)
    metrics.py     what a log line measures (loss window, tokens/s) and where it goes
    remat.py       activation checkpointing, applied to the model from outside
    plan/          hardware presets, the memory plan, the layout, the run's batch plan
    data/          token shards, the training order, the loader
    optim/         AdamW groups, Muon, the learning-rate schedule
    dist/          the Backend protocol, the CPU/CUDA backend, the control plane, FSDP2
    xla/           the TPU backend: platform checks, the step's While, SPMD sharding, flash
    checkpoint/    checkpoint folders, DCP I/O, the training state, resume, reading one

Sub-packages import only those below them in this order: data, plan, optim, dist, xla,
checkpoint, then metrics, remat, launch, loop (tests/core/test_structure.py holds it). train/
imports
codex/ (config, I/O), model/ and pipeline/ (the tokenizer's artifact); never eval/.
"""
