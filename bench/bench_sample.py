"""Time per generated token at several positions, with and without the KV cache, on the CPU.

    PYTHONPATH=. python bench/bench_sample.py                       # 1 thread, positions 64..1024
    PYTHONPATH=. python bench/bench_sample.py --threads 2 --positions 128 512 1024

At position p the model has seen p tokens (a random prompt). With the cache, a token is one
decode step (model/gpt.py decode) over the preallocated max_seq_len cache: its cost does not
depend on p. Without it, a token is a full forward over the p tokens so far (eval/sample.py with
use_cache=False): its cost grows with p. Each row times --tokens consecutive tokens (greedy
argmax included) after a warm-up token, and reports the median per token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from codex.core.config.model import ModelConfig
from codex.model.gpt import build_model, decode, prefill


def per_token_ms(step, n: int) -> float:
    """Median milliseconds of n calls of step(i), after one warm-up call."""
    step(-1)
    times = []
    for i in range(n):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


@torch.no_grad()
def bench_position(model, p: int, n: int, vocab: int) -> tuple[float, float]:
    """(cached, uncached) milliseconds per token at position p."""
    ids = torch.randint(0, vocab, (1, p + n + 1), generator=torch.Generator().manual_seed(p))
    _, cache = prefill(model, ids[:, : p - 1])

    # appends the token at position p + i (i = -1: the warm-up) and predicts the next
    def cached(
        i,
    ):
        int(decode(model, ids[:, p + i : p + i + 1], cache).argmax())

    def uncached(i):
        int(model(ids[:, : p + i + 1])[:, -1].argmax())

    return per_token_ms(cached, n), per_token_ms(uncached, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, nargs="+", default=[64, 256, 512, 1024])
    ap.add_argument("--tokens", type=int, default=8, help="tokens timed per position")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_len = max(args.positions) + args.tokens + 2
    cfg = ModelConfig(
        vocab_size=args.vocab,
        n_layer=args.layers,
        n_embd=args.dim,
        n_head=args.dim // 64,
        n_kv_head=max(1, args.dim // 128),
        max_seq_len=max_len,
    )
    model = build_model(cfg, seed=0).eval()
    print(
        f"model: {args.layers} layers, d={args.dim}, {cfg.n_head} heads ({cfg.n_kv_head} kv), "
        f"vocab {args.vocab}, "
        f"max_seq_len {max_len} (the cache's length); CPU, {args.threads} thread(s), fp32; "
        f"median of {args.tokens} tokens\n"
    )
    print(f"{'position':>8}  {'KV cache ms/token':>17}  {'no cache ms/token':>17}  {'speed-up':>8}")
    for p in args.positions:
        c, u = bench_position(model, p, args.tokens, args.vocab)
        print(f"{p:>8}  {c:>17.2f}  {u:>17.2f}  {u / c:>7.1f}x")


if __name__ == "__main__":
    main()
