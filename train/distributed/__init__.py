"""Running on CPU/CUDA ranks: the Backend protocol every device offers and its CPU/CUDA
implementation with the gradient all-reduce (backend.py; its replicated buckets, issued from
the backward: reduce.py), the process's environment before its process group exists
(process_env.py), the host-side gloo control plane (control.py: barrier, stop flag, same-config
check), FSDP2 sharding (fsdp.py).

Imports plan/ only; the TPU backend (xla/) builds on this, never the reverse.
"""
