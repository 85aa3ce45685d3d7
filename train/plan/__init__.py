"""What a run will be, decided before anything is built: hardware presets (hardware.py), the
memory plan (memory.py: bytes per device, auto layout, the default batch), the layout
(layout.py: replicate or fsdp x replicas) and the run's plan (plan.py: vocab, B, T, accum, steps).

Imports data/ (the shard manifest) only; no device code.
"""
