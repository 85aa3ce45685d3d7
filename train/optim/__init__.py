"""The optimizer: AdamW parameter groups, building Muon + AdamW or AdamW, clipping and loading a
saved state (optimizer.py), Muon itself (muon.py), the learning-rate schedule (schedule.py).

Imports no other part of train/.
"""
