"""How much does evaluate()'s bookkeeping cost over a bare forward loop? (CPU, fp32)

    python bench/bench_eval.py [--vocab 8192] [--batch 8] [--seq 256] [--batches 12]

evaluate() adds per-token losses (reduction="none"), a token_bytes gather over the targets, fp64
accumulation and the row mask; this prints tokens/s for a plain `model(x, y)` mean-loss loop, for
evaluate() and for evaluate() with masked fixed-shape batches, plus the overhead in percent.
"""

from __future__ import annotations

import argparse
import time

import torch

from codex.core.config.model import ModelConfig
from codex.eval.evaluate import evaluate
from codex.model.gpt import build_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = ModelConfig(vocab_size=a.vocab, max_seq_len=a.seq)  # the default 4 x 128 model
    model = build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randint(0, a.vocab, (a.batch, a.seq), generator=g),
            torch.randint(0, a.vocab, (a.batch, a.seq), generator=g),
        )
        for _ in range(a.batches)
    ]
    masked = [(x, y, torch.ones(a.batch, dtype=torch.bool)) for x, y in data]
    tb = torch.randint(1, 6, (a.vocab,), generator=g, dtype=torch.int32)
    tokens = a.batches * a.batch * a.seq

    def plain():
        with torch.no_grad():
            s = 0.0
            for x, y in data:
                s += float(model(x, targets=y))
        return s

    def ours():
        return evaluate(model, data, tb)

    def ours_masked():
        return evaluate(model, masked, tb)

    rows = []
    for name, fn in (
        ("forward mean loss", plain),
        ("evaluate()", ours),
        ("evaluate() masked", ours_masked),
    ):
        fn()  # warm up
        best = min(_timed(fn) for _ in range(3))
        rows.append((name, best, tokens / best))
    base = rows[0][1]
    print(
        f"model 4x128, vocab {a.vocab}, {a.batches} batches of {a.batch}x{a.seq} = "
        f"{tokens} tokens, "
        f"{a.threads} threads, best of 3"
    )
    print(f"{'loop':<20} {'seconds':>8} {'tokens/s':>10} {'overhead':>9}")
    for name, t, tps in rows:
        print(f"{name:<20} {t:8.3f} {tps:10.0f} {100 * (t / base - 1):8.1f}%")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
