"""Training throughput: `codex train` (train/loop.py) against a bare PyTorch loop on the same model.

    python bench/bench_train.py                          # CPU: tiny preset, codex vs bare loop
    python bench/bench_train.py --models 124m --vocab 4096 --batch 64 --seq 1024   # on a GPU

The bare loop is what codex's overhead is measured against: the same model (model/gpt.py), the
same batch, forward, backward, the optimizer step, nothing else (no loader thread, no grad
clipping, no logging, no all-reduce call, no checkpoint). On a GPU it is nanoGPT's bench.py: the
model under torch.compile, torch's fused AdamW (--bare nanogpt, the CUDA default), and codex runs
once with each optimizer (--optimizer adamw muon), so one table answers both targets: codex's MFU
at least the bare loop's, and a Muon step at most 10% over an AdamW step. On the CPU (--bare same,
the default there) the bare loop builds the row's optimizer with codex's own make_optimizer.
codex runs its full loop (loader, LR schedule, clipping, metrics.jsonl, progress) with checkpoints
and validation off. Both are timed over the same steps after a warm-up, after a blocking device
sync; the two are interleaved `--repeats` times and the median is reported. The table also gives
each side's peak device memory and what codex's memory plan said before the run.

Data: the bytes of tinyshakespeare (+3 for the special ids) as a byte-level vocab on the CPU; on
CUDA random tokens over --vocab (the model's speed does not depend on the text).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from codex.core.config import build_config  # noqa: E402
from codex.core.config.train import DEFAULT_LR  # noqa: E402
from codex.eval.evaluate import evaluate  # noqa: E402
from codex.model.gpt import build_model, flops_per_token  # noqa: E402
from codex.train.loop import train  # noqa: E402
from codex.train.optim.optimizer import make_optimizer  # noqa: E402
from codex.train.plan.batch import device_defaults  # noqa: E402
from codex.train.plan.memory import setting_for  # noqa: E402
from codex.train.plan.presets import get_preset  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"  # the shared data


def make_run(root: Path, vocab: int, tokens: int) -> str:
    """A run directory with tokenizer meta + one train and one val shard (ARCHITECTURE.md)."""
    if vocab <= 259 and SHAKESPEARE.exists():
        data = np.frombuffer(SHAKESPEARE.read_bytes(), dtype=np.uint8).astype(np.uint16) + 3
        data = np.tile(data, max(1, tokens // len(data) + 1))[:tokens]
    else:
        data = np.random.default_rng(0).integers(3, vocab, tokens).astype(np.uint16)
    (root / "tokenizer").mkdir(parents=True, exist_ok=True)
    (root / "shards").mkdir(parents=True, exist_ok=True)
    (root / "tokenizer" / "tokenizer_meta.json").write_text(json.dumps({"vocab_size": vocab}))
    np.save(root / "tokenizer" / "token_bytes.npy", np.ones(vocab, dtype=np.int32))
    n_val = max(len(data) // 100, 10_000)
    np.save(root / "shards" / "train_00000.npy", data[n_val:])
    np.save(root / "shards" / "val_00000.npy", data[:n_val])
    manifest = {
        "format_version": 1,
        "tokenizer": {"vocab_size": vocab},
        "dtype": "uint16",
        "shards": [
            {
                "split": "train",
                "path": "train_00000.npy",
                "format": "npy",
                "tokens": len(data) - n_val,
            },
            {"split": "val", "path": "val_00000.npy", "format": "npy", "tokens": n_val},
        ],
    }
    (root / "shards" / "manifest.json").write_text(json.dumps(manifest))
    return str(root)


def codex_tokens_per_s(
    run: str,
    model: str,
    hardware: str,
    optimizer: str,
    B: int,
    T: int,
    warmup: int,
    steps: int,
    compile_: bool,
) -> dict:
    """Full codex loop; the metrics line at step warmup+steps covers exactly the timed steps.

    9 parameters: the run, what to train (model, hardware, optimizer) and how long, as the bare
    loop takes them."""
    shutil.rmtree(Path(run) / "checkpoints", ignore_errors=True)
    overrides = [
        f"train.hardware={hardware}",
        f"train.optimizer={optimizer}",
        f"train.device_batch={B}",
        f"train.seq_len={T}",
        f"train.max_steps={warmup + steps}",
        f"train.log_every={warmup}",
        "train.eval_every=0",
        "train.save_every=0",
        "train.wandb=off",
        f"train.compile={str(compile_).lower()}",
        "train.warmup_steps=2",
    ]
    if T > build_config(model=model).model.max_seq_len:
        overrides.append(f"model.max_seq_len={T}")
    cfg = build_config(overrides=overrides, model=model, run=run)
    train(cfg, evaluate)
    lines = [json.loads(line) for line in open(Path(run) / "metrics.jsonl") if '"train"' in line]
    # Lines every `warmup` steps (and at the end); the first one includes compile/warm-up time.
    seconds, prev, timed = 0.0, warmup, [rec for rec in lines if rec["step"] > warmup]
    for rec in timed:
        seconds += rec["step_time_s"] * (rec["step"] - prev)
        prev = rec["step"]
    assert prev == warmup + steps, lines
    mfus = [rec["mfu"] for rec in timed if "mfu" in rec]
    return {
        "tokens_per_s": B * T * steps / seconds,
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_gb": timed[-1].get("mem_peak_gb", timed[-1].get("mem_gb")),
        "plan_gb": timed[-1].get("mem_plan_gb"),
    }


def bare_tokens_per_s(
    run: str,
    model: str,
    optimizer: str,
    B: int,
    T: int,
    warmup: int,
    steps: int,
    device: str,
    compile_: bool,
) -> dict:
    """forward, backward, the optimizer step: nothing else. `optimizer`: codex's make_optimizer
    for train.optimizer=muon|adamw, or "fused-adamw", nanoGPT's bench.py: torch's fused AdamW,
    weight decay on the matrices only. Returns tokens/s and the peak device memory (GB, CUDA).

    9 parameters: the run, what to train (model, optimizer) and how long, on which device."""
    nanogpt = optimizer == "fused-adamw"
    optimizer = "adamw" if nanogpt else optimizer
    cfg = build_config(model=model, overrides=[f"train.optimizer={optimizer}"])
    cfg.train.lr = cfg.train.lr or DEFAULT_LR[optimizer]  # as make_plan resolves train.lr=0
    cfg.model.vocab_size = json.loads(
        (Path(run) / "tokenizer" / "tokenizer_meta.json").read_text()
    )["vocab_size"]
    if T > cfg.model.max_seq_len:
        cfg.model.max_seq_len = T
    data = np.load(Path(run) / "shards" / "train_00000.npy", mmap_mode="r")
    net = build_model(cfg.model, seed=0).to(device)
    fwd = torch.compile(net) if compile_ else net
    if nanogpt:
        t = cfg.train
        params = [p for p in net.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=device == "cuda")
    else:
        # what the codex loop builds: Muon's Newton-Schulz in the autocast dtype (bf16 on CUDA)
        opt = make_optimizer(net, cfg.train, device, torch.bfloat16 if device == "cuda" else None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rng = np.random.default_rng(0)
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device == "cuda"
        else torch.autocast("cpu", enabled=False)
    )

    def batch():
        starts = rng.integers(0, len(data) - T - 1, B)
        w = torch.from_numpy(np.stack([data[s : s + T + 1] for s in starts]).astype(np.int64))
        return w[:, :-1].to(device), w[:, 1:].to(device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    batches = [batch() for _ in range(8)]  # made before timing: the bare loop has no data cost
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        x, y = batches[i % len(batches)]
        with amp:
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    tokens_per_s = B * T * steps / (time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    return {"tokens_per_s": tokens_per_s, "peak_gb": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        nargs="*",
        default=None,
        help="model presets (default: tiny on CPU, 124m 350m on CUDA)",
    )
    ap.add_argument(
        "--hardware",
        default=None,
        help="hardware preset (default: cpu, or h200/h100/a100 by GPU name)",
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (both loops)")
    ap.add_argument(
        "--optimizer",
        nargs="+",
        choices=["muon", "adamw"],
        default=None,
        help="train.optimizer of the codex rows (default: both on CUDA, codex's default on CPU)",
    )
    ap.add_argument(
        "--bare",
        choices=["nanogpt", "same"],
        default=None,
        help="the bare loop's optimizer: nanogpt = torch's fused AdamW as nanoGPT's bench.py "
        "(default on CUDA), same = codex's make_optimizer for the row's optimizer (CPU default)",
    )
    ap.add_argument(
        "--batch", type=int, default=None, help="device batch (default: the memory plan's)"
    )
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: preset's)")
    ap.add_argument("--vocab", type=int, default=None, help="default 259 on CPU, 32768 on CUDA")
    args = ap.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    cuda = torch.cuda.is_available()
    if cuda:
        name = torch.cuda.get_device_name(0)
        hardware = args.hardware or next(
            (h for h in ("h200", "h100", "a100") if h.upper() in name.upper()), "h100"
        )
        models = args.models or ["124m", "350m"]
        steps, warmup, repeats = args.steps or 20, args.warmup or 10, args.repeats or 1
        vocab, device = args.vocab or 32768, "cuda"
        optimizers, bare = args.optimizer or ["adamw", "muon"], args.bare or "nanogpt"
    else:
        torch.set_num_threads(args.threads)
        hardware, models = args.hardware or "cpu", args.models or ["tiny"]
        steps, warmup, repeats = args.steps or 30, args.warmup or 5, args.repeats or 3
        vocab, device, name = args.vocab or 259, "cpu", f"CPU ({args.threads} thread)"
        optimizers = args.optimizer or [build_config().train.optimizer]
        bare = args.bare or "same"
    preset = get_preset(hardware)
    print(f"device: {name}  preset: {hardware}  torch {torch.__version__}  bare loop: {bare}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            mcfg = build_config(model=model).model
            B, T = device_defaults(preset, mcfg, setting_for(build_config().train, preset.kind))
            B, T = args.batch or B, args.seq or T
            run = make_run(
                Path(tmp) / model, vocab, tokens=max(2_000_000, 4 * B * T * (warmup + steps))
            )
            mcfg.vocab_size = vocab
            flops = flops_per_token(mcfg, T)
            for opt in optimizers:
                bare_opt = "fused-adamw" if bare == "nanogpt" else opt
                codex_runs, bare_runs, mfus, last = [], [], [], {}
                for _ in range(repeats):
                    b = bare_tokens_per_s(run, model, bare_opt, B, T, warmup, steps, device, cuda)
                    bare_runs.append(b["tokens_per_s"])
                    last = codex_tokens_per_s(
                        run, model, hardware, opt, B, T, warmup, steps, compile_=cuda
                    )
                    codex_runs.append(last["tokens_per_s"])
                    mfus.append(last["mfu"])
                cx, bx = statistics.median(codex_runs), statistics.median(bare_runs)
                bare_mfu = flops * bx / preset.peak_flops if preset.peak_flops else None
                rows.append(
                    {
                        "model": model,
                        "BxT": f"{B}x{T}",
                        "codex": opt,
                        "bare": bare_opt,
                        "bare_tps": bx,
                        "codex_tps": cx,
                        "codex_mfu": None if mfus[0] is None else statistics.median(mfus),
                        "bare_mfu": bare_mfu,
                        "codex_peak": last.get("peak_gb"),
                        "plan": last.get("plan_gb"),
                        "bare_peak": b["peak_gb"],
                    }
                )

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    def gb(v):
        return "-" if v is None else f"{v:.1f}"

    print(
        f"\n{'model':6} {'B x T':>9} {'codex':>6} {'bare':>11} {'bare tok/s':>11} "
        f"{'codex tok/s':>12} {'bare MFU':>9} {'codex MFU':>10} {'bare GB':>8} "
        f"{'codex GB':>9} {'plan GB':>8}"
    )
    for r in rows:
        print(
            f"{r['model']:6} {r['BxT']:>9} {r['codex']:>6} {r['bare']:>11} "
            f"{r['bare_tps']:11.0f} {r['codex_tps']:12.0f} {pct(r['bare_mfu']):>9} "
            f"{pct(r['codex_mfu']):>10} {gb(r['bare_peak']):>8} {gb(r['codex_peak']):>9} "
            f"{gb(r['plan']):>8}"
        )
    by = {(r["model"], r["codex"]): r["codex_tps"] for r in rows}
    for model in models:
        if (model, "muon") in by and (model, "adamw") in by:
            over = by[(model, "adamw")] / by[(model, "muon")] - 1
            print(f"{model}: a muon step takes {100 * over:+.1f}% longer than an adamw step")
    print(
        f"\n(median of {repeats} interleaved runs, {steps} timed steps after {warmup} warm-up "
        "steps; targets on a GPU: codex MFU >= the bare loop's, muon <= 10% over adamw)"
    )


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
