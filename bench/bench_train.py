"""Training throughput: `codex train` (train/loop.py) against a bare PyTorch loop on the same model
and the same optimizer.

    python bench/bench_train.py                      # CPU: tiny preset, codex vs bare loop
    python bench/bench_train.py --models 124m 350m   # on a CUDA machine: tokens/s and MFU
    python bench/bench_train.py --optimizer adamw    # both sides on AdamW

The bare loop is what codex's overhead is measured against: the same model (model/gpt.py), the
same batch, forward, backward, the same optimizer step, nothing else (no loader thread, no grad
clipping, no logging, no all-reduce call, no checkpoint). The optimizer is train.optimizer on both
sides (--optimizer; default codex's default, muon): the bare loop builds it with codex's own
make_optimizer (train/optim/optimizer.py: Muon for the blocks' matrices, its Newton-Schulz in bf16
on CUDA as codex runs it, + AdamW for the rest; or AdamW alone, fused on CUDA), and codex is run
with train.optimizer set to the same name. codex runs its full loop (loader, LR schedule,
clipping, metrics.jsonl, progress) with checkpoints and validation off. Both are timed over the
same steps after a warm-up, after a blocking device sync; the two are interleaved `--repeats`
times and the median is reported (this machine is shared, single runs are noisy).
Target: codex overhead <= 5% on the CPU. On CUDA it reports MFU from the hardware preset's peak.

Data: the bytes of tinyshakespeare (+3 for the special ids) as a byte-level vocab on the CPU; on
CUDA random tokens over a 32768 vocab (the model's speed does not depend on the text).
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
from codex.train.plan.hardware import device_defaults, get_preset  # noqa: E402

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
        "mem_gb": timed[-1].get("mem_gb"),
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
) -> float:
    """forward, backward, the optimizer step (codex's make_optimizer for train.optimizer=
    `optimizer`): nothing else.

    9 parameters: the run, what to train (model, optimizer) and how long, on which device."""
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
    # what the codex loop builds: Muon's Newton-Schulz in the autocast dtype (bf16 on CUDA)
    opt = make_optimizer(net, cfg.train, device, torch.bfloat16 if device == "cuda" else None)
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
    return B * T * steps / (time.perf_counter() - t0)


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
        choices=["muon", "adamw"],
        default=build_config().train.optimizer,
        help="train.optimizer on both sides (default: codex's default)",
    )
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
        vocab, device = 32768, "cuda"
    else:
        torch.set_num_threads(args.threads)
        hardware, models = args.hardware or "cpu", args.models or ["tiny"]
        steps, warmup, repeats = args.steps or 30, args.warmup or 5, args.repeats or 3
        vocab, device, name = 259, "cpu", f"CPU ({args.threads} thread)"
    preset = get_preset(hardware)
    print(
        f"device: {name}  preset: {hardware}  torch {torch.__version__}  "
        f"optimizer: {args.optimizer} (both loops)"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            mcfg = build_config(model=model).model
            B, T = device_defaults(preset, mcfg)
            run = make_run(
                Path(tmp) / model, vocab, tokens=max(2_000_000, 4 * B * T * (warmup + steps))
            )
            codex_runs, bare_runs, mfus, mem = [], [], [], None
            for _ in range(repeats):
                bare_runs.append(
                    bare_tokens_per_s(
                        run, model, args.optimizer, B, T, warmup, steps, device, compile_=cuda
                    )
                )
                c = codex_tokens_per_s(
                    run, model, hardware, args.optimizer, B, T, warmup, steps, compile_=cuda
                )
                codex_runs.append(c["tokens_per_s"])
                mfus.append(c["mfu"])
                mem = c["mem_gb"]
            cx, bx = statistics.median(codex_runs), statistics.median(bare_runs)
            mcfg.vocab_size = vocab
            bare_mfu = (
                flops_per_token(mcfg, T) * bx / preset.peak_flops if preset.peak_flops else None
            )
            rows.append(
                (
                    model,
                    f"{B}x{T}",
                    bx,
                    cx,
                    100 * (bx - cx) / bx,
                    None if mfus[0] is None else 100 * statistics.median(mfus),
                    None if bare_mfu is None else 100 * bare_mfu,
                    mem,
                )
            )
    print(
        f"\n{'model':6} {'B x T':>9} {'bare tok/s':>11} {'codex tok/s':>12} {'overhead':>9} "
        f"{'codex MFU':>10} {'bare MFU':>9} {'mem GB':>7}"
    )
    for model, bt, bx, cx, ov, mfu, bmfu, mem in rows:
        print(
            f"{model:6} {bt:>9} {bx:11.0f} {cx:12.0f} {ov:8.1f}% "
            f"{'-' if mfu is None else f'{mfu:.1f}%':>10} "
            f"{'-' if bmfu is None else f'{bmfu:.1f}%':>9} "
            f"{'-' if mem is None else f'{mem:.1f}':>7}"
        )
    print(
        f"\n(median of {repeats} interleaved runs, {steps} timed steps after {warmup} "
        "warm-up steps; overhead = (bare - codex) / bare; target <= 5%)"
    )


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
