"""The TPU backend (torch_xla): the backend (backend.py, and spawn_train), the checks before the
runtime starts (platform.py), the step's micro-batches as one While (step.py), SPMD fsdp sharding
(sharding.py), Pallas flash attention (flash.py).

Imports dist/ (the Backend protocol, the control plane) and plan/; never the loop.
"""
