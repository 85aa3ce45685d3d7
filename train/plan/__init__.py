"""What a run will be, decided before anything is built, in one pass (plan.py: make_plan): the
hardware preset (presets.py), the batch chosen and checked (batch.py), the bytes per device it
needs (memory.py, summing params.py and activations.py), the layout (layout.py), the steps; then
formatted for people (report.py).

Imports data/ (the shard manifest, when make_plan reads the run's files) only; no device code.
"""
