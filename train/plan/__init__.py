"""What a run will be, decided before anything is built: hardware presets (hardware.py, and
choose_batch: the batch, layout and accumulation a config resolves to), the memory plan
(memory.py: a typed Setting in, bytes per device out; the auto layout, the default batch), the
batch arithmetic (batch.py: gradient accumulation), the layout (layout.py: replicate or fsdp x
replicas) and the run's plan (plan.py: vocab, B, T, accum, steps).

Imports data/ (the shard manifest) only; no device code.
"""
