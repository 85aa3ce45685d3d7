"""Evaluation settings (`eval.*`)."""

from __future__ import annotations

from dataclasses import dataclass

from codex.core.config.setting import setting


@dataclass
class EvalConfig:
    checkpoint: str = setting("latest", "Checkpoint step, or latest.")
    max_tokens: int = setting(0, "Evaluate at most this many tokens; 0 = all.", ge=0)
    device_batch: int = setting(
        0, "Sequences per device per batch; 0 = the training device batch.", ge=0
    )
    data: list[str] = setting(
        [], "Other text to evaluate (files, globs, folders); none = the validation split."
    )
    max_new_tokens: int = setting(200, "codex sample: tokens to generate.", ge=0)
    temperature: float = setting(0.8, "codex sample: 0 = greedy.", ge=0)
    top_k: int = setting(50, "codex sample: sample from the k likeliest; 0 = all.", ge=0)
    seed: int = setting(0, "codex sample: the same seed gives the same text.", ge=0)
    tasks: list[str] = setting(
        [], "lm-eval-harness task names (e.g. hellaswag,arc_easy); none = bits per byte."
    )
    tasks_limit: int = setting(0, "lm-eval: at most this many examples per task; 0 = all.", ge=0)
    tasks_path: str = setting("", "lm-eval: a folder of extra task YAMLs (its include_path).")
