"""Speed to quality: training recipes side by side on the same data, model shape and token budget.

    python bench/bench_quality.py --corpus shakespeare               # every recipe below
    python bench/bench_quality.py --corpus demo --recipes adamw_demo200,defaults

shakespeare: ../shared/data/tinyshakespeare.txt, cut at blank lines into ~2,000-character
documents; the first 90% go through `codex data clean | tokenize (vocab 1024) | shard`, the model
is 4 layers x 128 wide, 4 heads, seq 128, 300 steps x 2,048 tokens, and the score is `codex eval
--data` on the last 10% (held-out bits per byte).
demo: configs/runs/demo.yaml exactly as `make demo` trains it (stdlib sources, 180 steps x 8,192
tokens with today's defaults; `adamw_demo200` is the old demo: AdamW, 200 steps), scored on its
pinned validation split.

The data stages run once; every recipe trains in its own copy of the prepared run, one after
another (run it alone: timings share 2 cores with nothing else). A recipe is a list of --set
overrides on top of the baseline, so each option is measured alone and in combination.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from codex.cli.demo import stdlib_inputs  # noqa: E402
from codex.core.config import CONFIGS_DIR, build_config  # noqa: E402
from codex.core.progress import setup_logging  # noqa: E402
from codex.eval.evaluate import evaluate  # noqa: E402
from codex.eval.run import run_eval  # noqa: E402
from codex.pipeline.clean.clean import run_clean  # noqa: E402
from codex.pipeline.shard.shard import run_shard  # noqa: E402
from codex.pipeline.tokenizer.tokenizer import run_tokenizer  # noqa: E402
from codex.train.loop import train  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"

# The old recipe, pinned: AdamW at lr 3e-3 for every tensor, cosine schedule, SwiGLU; on the demo,
# its 200 steps (the demo now trains 180 with the new defaults).
ADAMW = ["train.optimizer=adamw", "train.lr=0.003"]
MUON_BEST = ["train.optimizer=muon", "train.muon_lr=0.01", "train.lr=0.006"]  # today's defaults

RECIPES = {
    "adamw": ADAMW,
    "adamw_demo200": ADAMW + ["train.max_steps=200"],
    "defaults": [],  # whatever the config defaults are now
    "adamw_lr6e-3": ["train.optimizer=adamw", "train.lr=0.006"],
    "wsd": ADAMW + ["train.schedule=wsd"],
    "relu2": ADAMW + ["model.mlp=relu2"],
    "zero_init": ADAMW + ["model.zero_init_proj=true"],
    "softcap15": ADAMW + ["model.logit_softcap=15"],
    "value_embed": ADAMW + ["model.value_embed=true"],
    "bos_aligned": ADAMW + ["train.bos_aligned=true"],
    "muon": ["train.optimizer=muon", "train.muon_lr=0.02", "train.lr=0.003"],
    "muon_lr0.01": ["train.optimizer=muon", "train.muon_lr=0.01", "train.lr=0.003"],
    "muon_lr0.03": ["train.optimizer=muon", "train.muon_lr=0.03", "train.lr=0.003"],
    "muon_lr0.005": ["train.optimizer=muon", "train.muon_lr=0.005", "train.lr=0.003"],
    "muon_wsd": [
        "train.optimizer=muon",
        "train.muon_lr=0.02",
        "train.lr=0.003",
        "train.schedule=wsd",
    ],
    "muon_wsd_lr6e-3": [
        "train.optimizer=muon",
        "train.muon_lr=0.02",
        "train.schedule=wsd",
        "train.lr=0.006",
    ],
    "muon_wsd_relu2": [
        "train.optimizer=muon",
        "train.muon_lr=0.02",
        "train.lr=0.003",
        "train.schedule=wsd",
        "model.mlp=relu2",
    ],
    "muon_wsd_warmup0": [
        "train.optimizer=muon",
        "train.muon_lr=0.02",
        "train.lr=0.003",
        "train.schedule=wsd",
        "train.warmup_steps=0",
    ],
    "muon_lr0.01_wsd": [
        "train.optimizer=muon",
        "train.muon_lr=0.01",
        "train.lr=0.003",
        "train.schedule=wsd",
    ],
    "muon_lr0.01_wsd_lr6e-3": MUON_BEST + ["train.schedule=wsd"],
    "muon_best": MUON_BEST,
    "muon_best_zero_init": MUON_BEST + ["model.zero_init_proj=true"],
    "muon_best_softcap15": MUON_BEST + ["model.logit_softcap=15"],
    "muon_best_value_embed": MUON_BEST + ["model.value_embed=true"],
    "muon_best_bos_aligned": MUON_BEST + ["train.bos_aligned=true"],
    # model.depth=4: 4 layers x 256 (2 heads of 128); nanochat's width-scaled AdamW lr (0.0042)
    # vs 0.006
    "depth4": ["model.depth=4", "model.max_seq_len=128", "train.lr=0.0042"],
    "depth4_lr6e-3": ["model.depth=4", "model.max_seq_len=128", "train.lr=0.006"],
}

SHAKESPEARE_SETTINGS = [
    "data.clean.preset=code",
    "data.clean.code.enabled=false",
    "data.clean.workers=2",
    "data.tokenizer.vocab_size=1024",
    "data.shard.val_fraction=0.02",
    "data.shard.workers=2",
    "model.n_layer=4",
    "model.n_head=4",
    "model.n_kv_head=4",
    "model.n_embd=128",
    "model.max_seq_len=128",
    "train.hardware=cpu",
    "train.device_batch=16",
    "train.seq_len=128",
    "train.batch_tokens=2048",
    "train.max_steps=300",
    "train.log_every=50",
    "train.eval_every=0",
    "train.save_every=300",
    "train.wandb=off",
]


def write_shakespeare_docs(folder: Path) -> tuple[Path, Path]:
    """(train.jsonl, heldout.jsonl): ~2,000-character documents cut at blank lines, 90% / 10%."""
    text = SHAKESPEARE.read_text()
    cut = int(len(text) * 0.9)
    cut = text.index("\n\n", cut) + 2  # at a speech boundary
    out = []
    for name, part in (("train", text[:cut]), ("heldout", text[cut:])):
        docs, cur = [], ""
        for para in part.split("\n\n"):
            cur += para + "\n\n"
            if len(cur) >= 2000:
                docs.append(cur)
                cur = ""
        docs.append(cur) if cur.strip() else None
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        out.append(path)
    return out[0], out[1]


def prepare(kind: str, root: Path) -> tuple[str, list[str], list[str]]:
    """(prepared run, base overrides, eval.data) with clean, tokenize and shard done."""
    run = root / "prepared"
    if kind == "shakespeare":
        train_docs, heldout = write_shakespeare_docs(root)
        base = SHAKESPEARE_SETTINGS + [f"data.clean.inputs=[{train_docs}]"]
        cfg, data = build_config(overrides=base, run=str(run)), [str(heldout)]
    else:
        base = []
        cfg, data = build_config(str(CONFIGS_DIR / "runs" / "demo.yaml"), run=str(run)), []
        cfg.data.clean.inputs = stdlib_inputs()
    for stage in (run_clean, run_tokenizer, run_shard):
        stage(cfg)
    return str(run), base, data


def train_and_score(
    kind: str, prepared: str, base: list[str], data: list[str], recipe: list[str], run: Path
) -> dict:
    shutil.copytree(
        prepared, run, ignore=shutil.ignore_patterns("checkpoints", "eval", "metrics.jsonl")
    )
    config_file = str(CONFIGS_DIR / "runs" / "demo.yaml") if kind == "demo" else None
    cfg = build_config(config_file, base + recipe, run=str(run))
    if kind == "demo":
        cfg.data.clean.inputs = stdlib_inputs()
    t0 = time.perf_counter()
    summary = train(cfg, evaluate)
    wall = time.perf_counter() - t0
    cfg.eval.data = data
    result = run_eval(cfg)
    return {
        "bits_per_byte": result["bits_per_byte"],
        "loss": result["loss"],
        "train_s": wall,
        "tokens": summary["tokens"],
        "final_train_loss": summary["loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--corpus", choices=["shakespeare", "demo"], default="shakespeare")
    ap.add_argument(
        "--recipes", default=",".join(RECIPES), help=f"comma-separated, from {', '.join(RECIPES)}"
    )
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup_logging()
    torch.set_num_threads(args.threads)
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        ap.error(f"unknown recipes {unknown}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="codex-quality-") as tmp:
        prepared, base, data = prepare(args.corpus, Path(tmp))
        for name in names:
            r = train_and_score(args.corpus, prepared, base, data, RECIPES[name], Path(tmp) / name)
            rows.append((name, r))
            print(f"RESULT {json.dumps({name: r})}", flush=True)
    print(f"\n{args.corpus}: held-out bits per byte")
    print(f"{'recipe':<22} {'tokens':>10} {'bits/byte':>9} {'loss':>7} {'train s':>8}  overrides")
    for name, r in rows:
        print(
            f"{name:<22} {r['tokens']:>10,} {r['bits_per_byte']:>9.4f} {r['loss']:>7.4f} "
            f"{r['train_s']:>8.1f}  "
            f"{' '.join(RECIPES[name])}"
        )


if __name__ == "__main__":
    main()
