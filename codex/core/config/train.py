"""Training settings (`train.*`). Hardware presets live in configs/hardware/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# train.lr when left at 0, per optimizer: the best of bench/bench_quality.py's sweeps (README,
# "Speed to quality"). With Muon, AdamW trains only embeddings, head and norms, which take a
# higher rate. Not scaled with the width: (n_embd / 128) ** -0.5, nanochat's AdamW scaling, lost
# at 4 x 256 (2.177 vs 2.158 bits per byte at 0.006; bench_quality depth4 vs depth4_lr6e-3).
DEFAULT_LR = {"muon": 0.006, "adamw": 0.003}


@dataclass
class TrainConfig:
    hardware: str = "cpu"  # cpu, a100-8, h100, h200-8, v6e-4, v5litepod-8, ... (`codex hardware`)
    device_batch: int = 0  # sequences per device per micro-batch; 0 = the preset's default
    seq_len: int = 0  # 0 = the preset's default
    batch_tokens: int = 0  # tokens per optimizer step; 0 = device_batch * seq_len * world
    max_steps: int = 1000
    max_tokens: int = 0  # > 0: a token budget instead of max_steps
    # AdamW's peak lr; 0 = DEFAULT_LR[optimizer] (with muon: embeddings, head, norms)
    lr: float = 0.0
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    schedule: Literal["cosine", "wsd"] = "cosine"  # wsd = warmup-stable-decay
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    # muon: Muon for the blocks' matrices, AdamW for the rest
    optimizer: Literal["adamw", "muon"] = "muon"
    # Muon's peak learning rate (the schedule scales it as it scales train.lr)
    muon_lr: float = 0.01
    muon_momentum: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1337
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 on CUDA/TPU, fp32 on CPU
    compile: bool = True  # torch.compile on CUDA
    # CPU threads per process (torch, OpenMP, tokenizers); 0 = OMP_NUM_THREADS when set, else the
    # physical cores / the training processes on this machine (train/plan/threads.py). On a CPU
    # shared with other jobs, fewer threads can be several times faster.
    threads: int = 0
    # auto: replicate when the replicated state fits (train/plan/memory.py)
    parallel: Literal["auto", "replicate", "fsdp"] = "auto"
    # fsdp: devices one copy of the state is sharded over; 0 = all (smaller: HSDP)
    fsdp_size: int = 0
    # The dtype gradients are summed over the ranks in (CPU/CUDA). bf16: half the bytes on the
    # wire, each rank's gradient rounded to bf16 before the sum, the result cast back into the fp32
    # gradients (replicate: train/distributed/reduce.py's buckets; fsdp: FSDP2's reduce_dtype,
    # which also
    # accumulates the micro-batches' unsharded gradients in bf16). XLA reduces in fp32.
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # block: recompute every transformer block in the backward (train/remat.py)
    remat: Literal["none", "block"] = "none"
    log_every: int = 10
    eval_every: int = 200
    eval_tokens: int = 0  # 0 = the whole validation split
    save_every: int = 500
    keep_last: int = 3
    keep_every: int = 0  # also keep every M-th step forever (0 = off)
    # periodic checkpoints written in the background while training goes on
    async_save: bool = False
    resume: Literal["auto", "never"] = "auto"  # auto: resume when a checkpoint exists
    # auto: online with an API key, else offline
    wandb: Literal["auto", "online", "offline", "off"] = "auto"
    wandb_project: str = "codex"
    xla_mode: Literal["spmd", "spawn"] = "spmd"  # spawn: one process per chip
    # cached: micro-batches in one While, and the optimizer update, each traced once
    # (train/xla/step.py, train/xla/update.py)
    xla_step: Literal["cached", "traced"] = "cached"
    xla_cache: str = ""  # persistent compilation cache; default RUN/xla_cache
    max_compiles: int = 0  # > 0: fail when the XLA compile count exceeds it
    allow_cpu_xla: bool = False  # run the XLA path on PJRT_DEVICE=CPU (tests)
    # a multi-host preset or torchrun over several nodes with a local --run: true = every host
    # sees it (NFS); checked at start (ControlPlane.check_shared_dir)
    shared_run_dir: bool = False
    # CPU/CUDA process groups (as torchtitan): collectives may wait this long until this process's
    # first step is done (start-up, checkpoint load, torch.compile), then train.dist_timeout_s. A
    # hung peer then ends the job after that (NCCL dumps its flight recorder); a dead one at once.
    dist_init_timeout_s: float = 600.0
    dist_timeout_s: float = 300.0
    # Python's garbage collector off during training, generations 0-1 collected every gc_every
    # steps (torchtitan's GarbageCollection): an automatic collection can start on any rank at
    # any allocation and stall it for long, making every rank wait at the next collective;
    # 0 = leave the collector automatic
    gc_every: int = 50
    bos_aligned: bool = False  # training windows start at a document's <|bos|> where one fits
    # > 0: block shuffle over groups of K shards (bounded gs:// cache); 0 = full shuffle
    shuffle_shards: int = 0
