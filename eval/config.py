"""Evaluation settings (`eval.*`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalConfig:
    checkpoint: str = "latest"      # a step number or "latest"
    max_tokens: int = 0             # 0 = the whole validation split
    device_batch: int = 0           # 0 = the training device batch
