"""Checkpoints: folders, the DONE marker, damage checks and retention (folders.py), saves written
in the background by a writer process (async_save.py), one folder through
torch.distributed.checkpoint (dcp.py), the training state saved and restored on every
rank (state.py), which checkpoint every rank resumes from (resume.py), reading a finished one in
one process for eval, sample and export (read.py).

Imports distributed/ (the control plane), optim/ (the optimizer's parts) and xla/ (host copies of
sharded tensors).
"""
