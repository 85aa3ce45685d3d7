"""Evaluation settings (`eval.*`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalConfig:
    checkpoint: str = "latest"  # a step number or "latest"
    max_tokens: int = 0  # 0 = the whole validation split
    device_batch: int = 0  # 0 = the training device batch
    # other text to evaluate (files/globs/dirs); [] = the val split
    data: list[str] = field(default_factory=list)
    max_new_tokens: int = 200  # codex sample: tokens to generate
    temperature: float = 0.8  # codex sample: 0 = greedy
    top_k: int = 50  # codex sample: 0 = the whole vocabulary
    seed: int = 0  # codex sample: same seed, same text
    # codex eval --tasks: lm-eval-harness task names; [] = bits per byte
    tasks: list[str] = field(default_factory=list)
    tasks_limit: int = 0  # codex eval --tasks: at most this many examples per task (0 = all)
    tasks_path: str = ""  # codex eval --tasks: a folder of extra task YAMLs (lm-eval include_path)
