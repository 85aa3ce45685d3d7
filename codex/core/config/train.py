"""Training settings (`train.*`). Hardware presets live in configs/hardware/*.yaml."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from codex.core.config.setting import ConfigError, setting

# train.lr when left at 0, per optimizer: the best of bench/bench_quality.py's sweeps (README,
# "Speed to quality"). With Muon, AdamW trains only embeddings, head and norms, which take a
# higher rate. Not scaled with the width: (n_embd / 128) ** -0.5, nanochat's AdamW scaling, lost
# at 4 x 256 (2.177 vs 2.158 bits per byte at 0.006; bench_quality depth4 vs depth4_lr6e-3).
DEFAULT_LR = {"muon": 0.006, "adamw": 0.003}


@dataclass
class TrainDataConfig:
    """What the training loader draws (train/data/mixture.py; docs/training.md, "Mixtures")."""

    mixture: dict[str, float] = setting(
        {},
        "Weights per source of the shards (data.shard.sources' names), e.g. {web: 0.7, code: "
        "0.3} or web:0.7,code:0.3; each step's sequences follow them; {} = every window once "
        "an epoch, whatever its source.",
    )
    mixture_schedule: list[dict] = setting(
        [],
        "Weights that take over at a step, a YAML list: [{step: 1000, mixture: {web: 0.5, "
        "code: 0.5}}, ...]; before the first, train.data.mixture.",
    )


@dataclass
class TrainConfig:
    hardware: str = setting(
        "cpu", "Hardware preset: cpu, h100, h200-8, v6e-4, ... (`codex hardware`)."
    )
    data_run: str = setting(
        "",
        "Train on this run's tokenizer/ and shards/ (local or gs://), nothing copied; checkpoints, "
        'metrics and the lock stay in --run. "" = --run\'s own. Recorded: resume refuses another.',
    )
    device_batch: int = setting(
        0, "Sequences per device per micro-batch; 0 = the memory plan's.", ge=0
    )
    seq_len: int = setting(0, "Sequence length; 0 = the preset's.", ge=0)
    batch_tokens: int = setting(
        0,
        "Tokens per optimizer step; gradient accumulation is derived. 0 with train.device_batch "
        "0 = the preset's batch_tokens for the model where it names one (cpu: 8192 for tiny and "
        "custom shapes, in micro-batches of the memory plan's), else device_batch * seq_len * "
        "world (one micro-batch a step).",
        ge=0,
    )
    max_steps: int = setting(1000, "Optimizer steps to train.", ge=0)
    max_tokens: int = setting(0, "A token budget instead of max_steps; 0 = off.", ge=0)
    lr: float = setting(
        0.0,
        "AdamW's peak learning rate (with muon: embeddings, head, norms); "
        "0 = the optimizer's default (DEFAULT_LR).",
        ge=0,
    )
    min_lr_ratio: float = setting(
        0.1, "The schedule's last lr, as a fraction of the peak.", ge=0, le=1
    )
    warmup_steps: int = setting(50, "Steps of linear warmup.", ge=0)
    schedule: Literal["cosine", "wsd"] = setting(
        "cosine", "Learning-rate schedule; wsd = warmup-stable-decay."
    )
    decay_fraction: float = setting(0.2, "wsd: the last fraction of steps decays.", ge=0, le=1)
    weight_decay: float = setting(0.1, "AdamW's weight decay (matrices only).", ge=0)
    beta1: float = setting(0.9, "AdamW's beta1.", ge=0, le=1)
    beta2: float = setting(0.95, "AdamW's beta2.", ge=0, le=1)
    optimizer: Literal["adamw", "muon"] = setting(
        "muon", "muon: Muon for the blocks' matrices, AdamW for the rest."
    )
    muon_lr: float = setting(
        0.01, "Muon's peak learning rate (the schedule scales it as it scales lr).", gt=0
    )
    muon_momentum: float = setting(0.95, "Muon's momentum.", ge=0, le=1)
    grad_clip: float = setting(1.0, "Clip the gradient's global norm to this; 0 = off.", ge=0)
    seed: int = setting(1337, "Seed of the weights' init and the data order.", ge=0)
    dtype: Literal["auto", "bf16", "fp32"] = setting(
        "auto", "Compute dtype; auto: bf16 on CUDA/TPU, fp32 on CPU."
    )
    compile: bool = setting(True, "torch.compile the model on CUDA.")
    # On a CPU shared with other jobs, fewer threads can be several times faster.
    threads: int = setting(
        0,
        "CPU threads per process (torch, OpenMP, tokenizers); 0 = OMP_NUM_THREADS when set, "
        "else the physical cores / the training processes here (train/plan/threads.py).",
        ge=0,
    )
    parallel: Literal["auto", "replicate", "fsdp"] = setting(
        "auto", "Layout; auto: replicate when the replicated state fits (train/plan/memory.py)."
    )
    fsdp_size: int = setting(
        0, "fsdp: devices one copy of the state is sharded over; 0 = all (smaller: HSDP).", ge=0
    )
    # bf16 halves the bytes on the wire: each rank's gradient is rounded to bf16 before the sum,
    # the result cast back into the fp32 gradients (replicate: train/distributed/reduce.py's
    # buckets; fsdp: FSDP2's reduce_dtype, which also accumulates the micro-batches' unsharded
    # gradients in bf16).
    reduce_dtype: Literal["fp32", "bf16"] = setting(
        "fp32", "The dtype gradients are summed over the ranks in (CPU/CUDA; XLA reduces in fp32)."
    )
    remat: Literal["auto", "none", "block"] = setting(
        "auto",
        "block: recompute every transformer block in the backward (train/remat.py); auto: "
        "on TPU the plan's fastest modelled step (train/plan/step_time.py), elsewhere none.",
    )
    log_every: int = setting(10, "Log the loss every N steps.", ge=1)
    eval_every: int = setting(200, "Validate every N steps and at the last; 0 = never.", ge=0)
    eval_tokens: int = setting(0, "Validation tokens; 0 = the whole validation split.", ge=0)
    save_every: int = setting(500, "Checkpoint every N steps; 0 = only at the end.", ge=0)
    keep_last: int = setting(3, "Checkpoints kept, newest first.", ge=1)
    keep_every: int = setting(0, "Also keep every M-th step forever; 0 = off.", ge=0)
    async_save: bool = setting(
        False, "Write periodic checkpoints in the background while training goes on."
    )
    # A spot or preemptible VM is told by SIGTERM and killed this long after (GCE: 30 s); the
    # save codex makes on SIGTERM must end within it, or the steps since the last save are lost.
    preempt_notice_s: float = setting(
        30.0,
        "Seconds from a preemption's SIGTERM to the kill; codex warns at start when a checkpoint "
        "save would take longer (train/plan/save_time.py). 0 = no check.",
        ge=0,
    )
    save_rate_gbs: float = setting(
        0.0,
        "GB/s one host writes a checkpoint at, for the save-time estimate and the preemption "
        "warning; 0 = codex's figure for the run's store (train/plan/save_time.py). Measure "
        "yours: python bench/bench_checkpoint_streams.py --gs gs://BUCKET/PREFIX.",
        ge=0,
    )
    resume: Literal["auto", "never"] = setting("auto", "auto: resume when a checkpoint exists.")
    wandb: Literal["auto", "online", "offline", "off"] = setting(
        "auto", "Weights & Biases logging; auto: online with an API key, else offline."
    )
    wandb_project: str = setting("codex", "The wandb project.")
    xla_mode: Literal["spmd", "spawn"] = setting(
        "spmd", "TPU: spmd (one process per host) or spawn (one process per chip)."
    )
    xla_step: Literal["cached", "traced"] = setting(
        "cached",
        "TPU: cached traces the micro-batches' While and the update once each "
        "(train/xla/step.py, update.py).",
    )
    xla_cache: str = setting("", 'TPU: persistent compilation cache; "" = RUN/xla_cache.')
    max_compiles: int = setting(
        0, "TPU: fail when XLA compiles more programs than this; 0 = no limit.", ge=0
    )
    allow_cpu_xla: bool = setting(
        False, "Run a TPU preset on the XLA CPU backend (PJRT_DEVICE=CPU; tests only)."
    )
    shared_run_dir: bool = setting(
        False,
        "Several hosts with a local --run: true = every host sees the folder (NFS); "
        "checked at start.",
    )
    # As torchtitan: a hung peer ends the job after the timeout (NCCL dumps its flight recorder);
    # a dead one at once.
    dist_init_timeout_s: float = setting(
        600.0,
        "CPU/CUDA collectives may wait this long until the first step is done "
        "(start-up, checkpoint load, torch.compile).",
        gt=0,
    )
    dist_timeout_s: float = setting(
        300.0, "CPU/CUDA collectives may wait this long after the first step.", gt=0
    )
    # An automatic collection can start on any rank at any allocation and stall it for long,
    # making every rank wait at the next collective (torchtitan's GarbageCollection).
    gc_every: int = setting(
        50,
        "Python's GC off while training, generations 0-1 collected every N steps; "
        "0 = leave it automatic.",
        ge=0,
    )
    bos_aligned: bool = setting(
        False, "Training windows start at a document's <|bos|> where one fits."
    )
    shuffle_shards: int = setting(
        0, "Block shuffle over groups of K shards (bounded gs:// cache); 0 = full shuffle.", ge=0
    )
    data: TrainDataConfig = field(default_factory=TrainDataConfig)


SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_mixture(d: TrainDataConfig) -> None:
    """train.data.mixture and each mixture of train.data.mixture_schedule: source names, weights
    >= 0 summing to more than 0; schedule steps increasing. A ConfigError naming the key."""
    check_weights("train.data.mixture", d.mixture, "train.data.mixture")
    last = -1
    for i, entry in enumerate(d.mixture_schedule):
        key = f"train.data.mixture_schedule[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"step", "mixture"}:
            raise ConfigError(
                f"{key}: expected {{step: N, mixture: {{NAME: WEIGHT, ...}}}}",
                ("train.data.mixture_schedule",),
            )
        step = entry["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step <= last:
            raise ConfigError(
                f"{key}.step: expected an integer step after {max(last, 0)}, got {step!r}",
                ("train.data.mixture_schedule",),
            )
        last = step
        if not isinstance(entry["mixture"], dict):
            raise ConfigError(f"{key}.mixture: expected a mapping NAME: WEIGHT", (key,))
        check_weights(f"{key}.mixture", entry["mixture"], "train.data.mixture_schedule")
        if not d.mixture:
            raise ConfigError(
                f"{key}: a schedule changes train.data.mixture, which is empty: set it too",
                ("train.data.mixture_schedule",),
            )


def check_weights(key: str, weights: dict, top: str) -> None:
    """Source names and weights of one mixture (an empty one is allowed: no mixture); `top`: the
    setting that holds it."""
    for name, w in weights.items():
        if not isinstance(name, str) or not SOURCE_NAME.fullmatch(name):
            raise ConfigError(
                f"{key}: {name!r} is not a source name (letters, digits, _ . -)", (top,)
            )
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
            raise ConfigError(f"{key}.{name}: the weight must be a number >= 0, got {w!r}", (top,))
    if weights and not sum(weights.values()) > 0:
        raise ConfigError(f"{key}: the weights add up to 0; give one source a weight > 0", (top,))
