"""The training loop, top to bottom: `train(cfg) -> dict`.

    backend -> tokenizer meta (vocab size) -> model -> optimizer -> loader -> resume
    for step in range(start, total):
        lr = lr_for(step)
        for micro-batch in range(accum):           # no communication here (fsdp: the last one reduce-scatters;
                                                   #   XLA: one While traced once, train/xla_step.py)
            loss = model(x, y) / accum; loss.backward()
        backend.all_reduce_grads(model)            # THE gradient all-reduce, once per step (fsdp: done in backward)
        clip (on the all-reduced gradient); optimizer.step(); backend.step_boundary()
        every log_every: sync, tokens/s, MFU, memory  every eval_every: val loss + bits per byte
        every save_every (and on SIGTERM/SIGINT and at the end): checkpoint, every rank its own part

Batch: train.batch_tokens tokens per optimizer step = device_batch * seq_len * world * accum.
Every micro-batch holds B*T tokens and every rank the same number of micro-batches, so dividing
each micro-batch's mean loss by accum and averaging gradients over ranks gives exactly the
gradient of the mean loss over every token of the step, the same as one big batch.

Exit paths: the end of training, or SIGTERM/SIGINT (a spot VM gets ~30 s): the current step
finishes, a checkpoint is written, train() returns {"stopped": True} and the process exits 0.
Running the same command again resumes from the newest intact checkpoint (train.resume=auto):
rank 0 picks it and every rank loads that step (train/control.py). A rank that raises skips the
clean-exit barrier, so the whole job ends non-zero within seconds instead of hanging.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from codex import fsio, rundir
from codex.config import ConfigError, save_config, to_dict
from codex.progress import Progress, setup_logging
from eval.evaluate import evaluate
from model.gpt import flops_per_token, mlp_hidden, num_params
from pipeline.tokenizer import TOKEN_BYTES_FILE, load_meta, load_token_bytes
from train import checkpoint
from train.backend import Backend, loader_layout, open_backend, unwrap
from train.config import DEFAULT_LR
from train.control import StopFlag, injected_step_fault, rank_tag, resume
from train.hardware import device_defaults, get_preset
from train.loader import TrainLoader, val_batches
from train.token_shards import load_manifest
from train.checkpoint import PendingSave
from train.train_state import restore_training, save_training
from train.measure import LossWindow, StepTimer
from train.fsdp import Layout, layout_for
from train.memory import MemoryPlan, check_fits, choose_layout, setting_for
from train.metrics import make_logger
from train.optim import clip_grad_norm, lr_for, make_optimizer, set_lr
from train.remat import apply_remat

log = logging.getLogger("codex.train")


# --- batch arithmetic -------------------------------------------------------------------------

def grad_accum_steps(batch_tokens: int, device_batch: int, seq_len: int, world_size: int) -> int:
    """accum = batch_tokens / (device_batch * seq_len * world_size), or a ConfigError that lists
    the nearest valid batch_tokens and the device batch sizes that would divide."""
    per_micro = device_batch * seq_len * world_size
    if batch_tokens <= 0:
        return 1
    if batch_tokens % per_micro == 0:
        return batch_tokens // per_micro
    lo = (batch_tokens // per_micro) * per_micro
    nearest = sorted((v for v in (lo, lo + per_micro) if v > 0), key=lambda v: (abs(v - batch_tokens), v))
    msg = (f"train.batch_tokens={batch_tokens} is not a multiple of device_batch * seq_len * world_size = "
           f"{device_batch} * {seq_len} * {world_size} = {per_micro}. Nearest valid batch_tokens: "
           + " or ".join(f"{v} (accum {v // per_micro})" for v in nearest))
    per_seq = seq_len * world_size
    if batch_tokens % per_seq == 0:
        seqs = batch_tokens // per_seq  # sequences per rank per step
        divisors = [b for b in range(1, seqs + 1) if seqs % b == 0]
        near = sorted(divisors, key=lambda b: (abs(b - device_batch), -b))[:4]
        msg += f"; or keep it and use train.device_batch in {sorted(near)} (accum = {seqs} / device_batch)"
    else:
        msg += f"; no device batch fits: batch_tokens must be a multiple of seq_len * world_size = {per_seq}"
    raise ConfigError(msg)


def resolve_batch(cfg, preset, world_size: int) -> tuple[int, int, int, int, MemoryPlan, Layout]:
    """(device_batch, seq_len, accum, batch_tokens, memory plan, layout) from train.* and the hardware
    preset defaults (the memory plan's); a setting whose memory plan cannot fit is refused (exit 2)."""
    B, T = cfg.train.device_batch, cfg.train.seq_len
    setting = setting_for(cfg.train, preset.kind)
    if B <= 0 or T <= 0:
        dB, dT = device_defaults(preset, cfg.model, **setting)
        B = B if B > 0 else dB
        T = T if T > 0 else dT
    if T > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len={T} is longer than model.max_seq_len={cfg.model.max_seq_len}; "
                          f"lower --seq-len or --set model.max_seq_len={T}")
    if setting["layout"] == "auto":   # train.parallel=auto: the memory plan picks
        setting["layout"] = choose_layout(cfg.model, preset, B, T, **setting)
    memory = check_fits(cfg.model, preset, B, T, **setting)
    layout = layout_for(setting["layout"], setting["fsdp_size"], world_size)
    accum = grad_accum_steps(cfg.train.batch_tokens, B, T, world_size)
    return B, T, accum, B * T * world_size * accum, memory, layout


# --- the plan: what the loop derives from the config and the run's files, once -----------------

@dataclass(frozen=True)
class Plan:
    vocab: int
    device_batch: int      # B: sequences per device per micro-batch
    seq_len: int           # T
    accum: int             # micro-batches per optimizer step
    batch_tokens: int      # tokens per optimizer step = B * T * world_size * accum
    total_steps: int
    world_size: int
    tokenizer_sha: str     # recorded in checkpoints: eval and sample refuse a retrained tokenizer
    memory: MemoryPlan     # bytes per device (train/memory.py), logged at start
    layout: Layout         # replicate or fsdp (train.parallel, resolved; train/fsdp.py)


def make_plan(cfg, preset, world_size: int):
    """(the resolved config, the Plan, token_bytes). The resolved config carries the tokenizer's
    vocab size, the MLP width (so a later change of the derivation cannot change a saved model's
    shape) and the learning rate (train.lr 0 = the optimizer's default): it is what checkpoints
    record and what eval rebuilds the model from."""
    vocab, token_bytes, tokenizer_sha = _read_vocab(cfg)
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab, mlp_hidden=mlp_hidden(cfg.model)),
                  train=replace(cfg.train, lr=cfg.train.lr or DEFAULT_LR[cfg.train.optimizer]))
    B, T, accum, batch_tokens, memory, layout = resolve_batch(cfg, preset, world_size)
    total_steps = math.ceil(cfg.train.max_tokens / batch_tokens) if cfg.train.max_tokens > 0 else cfg.train.max_steps
    if total_steps <= 0:
        raise ConfigError("train.max_steps (or train.max_tokens) must be positive")
    plan = Plan(vocab, B, T, accum, batch_tokens, total_steps, world_size, tokenizer_sha, memory, layout)
    return cfg, plan, token_bytes


def due(step: int, every: int, total_steps: int) -> bool:
    """True every `every` steps and at the last step; never when every <= 0."""
    return every > 0 and (step % every == 0 or step == total_steps)


# --- run inputs -------------------------------------------------------------------------------

def _read_vocab(cfg) -> tuple[int, torch.Tensor | None, str]:
    """Vocab size from the run's tokenizer meta (checked against the shard manifest), token_bytes
    for bits per byte (None when absent; validation then says what is missing), and the tokenizer's
    sha256 (recorded in checkpoints, so eval and sample can refuse a retrained tokenizer)."""
    tok_dir = rundir.tokenizer_dir(cfg.run)
    meta = load_meta(tok_dir)
    vocab = int(meta["vocab_size"])
    manifest = load_manifest(rundir.shards_dir(cfg.run))
    m_vocab = int(manifest.get("tokenizer", {}).get("vocab_size", vocab))
    if m_vocab != vocab:
        raise ConfigError(f"{fsio.join(rundir.shards_dir(cfg.run), 'manifest.json')}: shards were made with "
                          f"vocab_size {m_vocab}, but the tokenizer in {tok_dir} has {vocab}; re-run `codex data shard`")
    if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} but the run's tokenizer has {vocab} tokens; "
                          "leave model.vocab_size at 0 (taken from the tokenizer)")
    token_bytes = None
    if fsio.exists(fsio.join(tok_dir, TOKEN_BYTES_FILE)):
        token_bytes = torch.from_numpy(load_token_bytes(tok_dir).astype(np.int64))
    return vocab, token_bytes, str(meta.get("sha256", ""))


def validation_loss(cfg, model, backend: Backend, plan: Plan, token_bytes) -> dict:
    """Validation loss / perplexity / bits per byte over the val split (or train.eval_tokens), with
    the same evaluate() as `codex eval`."""
    if token_bytes is None:
        raise FileNotFoundError(f"{fsio.join(rundir.tokenizer_dir(cfg.run), 'token_bytes.npy')} not found: "
                                "needed for bits per byte; re-run `codex data tokenize`")
    rank, world, rows = loader_layout(backend, plan.device_batch)
    batches = val_batches(rundir.shards_dir(cfg.run), seq_len=plan.seq_len, batch_size=rows, rank=rank,
                          world_size=world, max_tokens=cfg.train.eval_tokens, with_mask=backend.fixed_shapes)
    # The uncompiled module: validation batches may have another shape than training's.
    return evaluate(unwrap(model), batches, token_bytes, backend=backend)


# --- the loop ---------------------------------------------------------------------------------

def train(cfg, xla_spawned: bool = False) -> dict:
    """Train cfg.model on cfg.run's shards. Returns a summary dict (step, tokens, losses, stopped).
    xla_spawned: this process is one of train.xla_mode=spawn's (train/xla_backend.spawn_train)."""
    setup_logging()
    with open_backend(cfg, xla_spawned=xla_spawned) as backend:
        return _train(cfg, backend)


def _train(cfg, backend: Backend) -> dict:
    # 75 lines on purpose: set-up, the optimizer step and the log/validate/save decisions read top to
    # bottom in one place, as in nanoGPT's train.py; each decision's body is a function below.
    # --- plan, model, optimizer, data ---
    preset = get_preset(cfg.train.hardware)
    backend.control.check_same_config(to_dict(cfg))   # every host got the same command and files
    cfg, plan, token_bytes = make_plan(cfg, preset, backend.world_size)
    tcfg = cfg.train
    model = backend.build_model(cfg.model, tcfg.seed, plan.layout)   # build_model's weights, placed (sharded)
    model = apply_remat(model, tcfg.remat, backend.kind)             # train.remat: checkpoint every block
    raw = unwrap(model)                               # without a torch.compile wrapper
    n_params = num_params(raw)
    optimizer = make_optimizer(raw, tcfg, backend.kind, backend.autocast_dtype)
    loader = _make_loader(cfg, backend, plan)
    accumulate = backend.device_accumulation(model, plan.accum)   # None: the Python micro-batch loop below

    # --- resume: rank 0 picks the newest intact checkpoint, every rank loads exactly it ---
    existing, step, tokens, log_window = _resume(cfg, backend, raw, optimizer, loader)
    if _nothing_to_do(backend, plan, step):
        return _summary(plan, step, tokens, stopped=False)
    metrics, progress = _start_run(cfg, backend, plan, preset, n_params, step, existing)
    stop = StopFlag().install()
    window, timer = LossWindow(backend, plan.accum, log_window), StepTimer(backend, step, tokens)
    last = {"loss": None, "val": {}, "saved_at": step if existing is not None else -1, "saving": None}
    model.train()
    try:
        while step < plan.total_steps:
            # --- one optimizer step ---
            injected_step_fault(backend.control, step)
            lr = set_lr(optimizer, lr_for(step, tcfg, plan.total_steps))
            if accumulate is not None:   # XLA: every micro-batch in one While, traced once (train/xla_step.py)
                window.add(accumulate(loader))
            for micro in range(plan.accum if accumulate is None else 0):
                backend.set_grad_sync(model, micro == plan.accum - 1)   # fsdp: reduce in the last backward only
                x, y = backend.to_device(next(loader))
                with backend.autocast():
                    loss = model(x, y)
                # Mean over the step's tokens: each micro-batch has B*T tokens, so /accum here
                # and the average over ranks in all_reduce_grads give the global token mean.
                (loss / plan.accum).backward()
                window.add(loss)
            backend.all_reduce_grads(raw)            # THE gradient all-reduce (once per step)
            grad_norm = clip_grad_norm(raw, tcfg.grad_clip)   # the global gradient: after the all-reduce
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            backend.step_boundary()
            step += 1
            tokens += plan.batch_tokens
            progress.update(1, tokens=plan.batch_tokens)

            # --- log, validate, save ---
            if due(step, tcfg.log_every, plan.total_steps):
                last["loss"] = _log_train(cfg, backend, plan, metrics, window, timer, step, tokens, lr, grad_norm)
            if due(step, tcfg.eval_every, plan.total_steps):
                with timer.pause():
                    last["val"] = _log_validation(cfg, backend, plan, metrics, model, token_bytes, step, tokens)
            stopping = backend.any_flag(stop.is_set)   # every rank stops at the same step
            if stopping or step == plan.total_steps or due(step, tcfg.save_every, plan.total_steps):
                with timer.pause():
                    last["saving"] = _save(cfg, backend, plan, model, optimizer, loader, metrics, window, step, tokens,
                                           reason="preempted" if stopping else "final" if step == plan.total_steps
                                           else "periodic", previous=last["saving"])
                last["saved_at"] = step
            if stopping:
                break
        if last["saving"] is not None:
            last["saving"].wait()   # the final and SIGTERM saves are synchronous; this is a no-op then
    finally:
        stop.restore()
        loader.close()
        progress.close()
        metrics.close()
    if step < plan.total_steps:
        _log_stopped(cfg, backend, plan, stop, step, last["saved_at"])
    return _summary(plan, step, tokens, stopped=step < plan.total_steps, loss=last["loss"], val=last["val"])


# --- the loop's parts, in the order they run ---------------------------------------------------

def _make_loader(cfg, backend: Backend, plan: Plan) -> TrainLoader:
    # One loader per process; under XLA SPMD it loads the batch of all the host's chips. On CUDA
    # it builds batches in pinned memory and copies them with non_blocking=True.
    rank, world, rows = loader_layout(backend, plan.device_batch)
    return TrainLoader(rundir.shards_dir(cfg.run), seq_len=plan.seq_len, batch_size=rows, rank=rank,
                       world_size=world, seed=cfg.train.seed, shuffle_shards=cfg.train.shuffle_shards,
                       device=backend.pinned_copy_device, bos_aligned=cfg.train.bos_aligned)


def _resume(cfg, backend: Backend, model, optimizer, loader) -> tuple[int | None, int, int, dict]:
    """(existing checkpoint step or None, step, tokens, the unfinished loss window); automatic
    when a checkpoint exists (train.resume=auto)."""
    existing, chosen = resume(backend.control, cfg.run, allow=cfg.train.resume != "never")
    if existing is not None and cfg.train.resume == "never":
        raise ConfigError(f"{rundir.checkpoints_dir(cfg.run)} already has checkpoints (up to step {existing}) and "
                          "--no-resume was given: use a new --run, or delete that folder to start over")
    if chosen is None:
        return existing, 0, 0, {"loss_sum": 0.0, "since": 0}
    step, tokens, log_window = restore_training(cfg, backend.control, chosen, model, optimizer, loader)
    if backend.is_main or backend.control.world > 1:
        log.info("%sresumed from step %d (%d tokens) in %s", rank_tag(backend.control), step, tokens,
                 rundir.checkpoints_dir(cfg.run))
    return existing, step, tokens, log_window


def _nothing_to_do(backend: Backend, plan: Plan, step: int) -> bool:
    if step < plan.total_steps:
        return False
    if backend.is_main:
        log.warning("nothing to do: the checkpoint is at step %d and this run ends at step %d; raise --max-steps "
                    "(or train.max_tokens) to train further, or use a new --run", step, plan.total_steps)
    return True


def _start_run(cfg, backend: Backend, plan: Plan, preset, n_params: int, step: int, existing: int | None):
    """Log what this run does and save its resolved config; returns (metrics logger, progress bar)."""
    metrics = make_logger(cfg, backend.is_main, resume_step=step if existing is not None else None,
                          config_dict=to_dict(cfg) | {"n_params": n_params, "accum": plan.accum,
                                                      "world_size": plan.world_size})
    progress = Progress("train" if step == 0 else f"train (resumed at step {step})", total=plan.total_steps - step,
                        unit="steps", enabled=backend.is_main)
    if not backend.is_main:
        return metrics, progress
    if cfg.train.warmup_steps >= plan.total_steps:
        log.warning("train.warmup_steps=%d covers the whole run (%d steps): the learning rate never reaches train.lr",
                    cfg.train.warmup_steps, plan.total_steps)
    fsio.makedirs(rundir.checkpoints_dir(cfg.run))
    save_config(cfg, fsio.join(rundir.checkpoints_dir(cfg.run), "config.yaml"))
    log.info("model %.2fM params | %s x%d (%s) | device_batch %d x seq_len %d x world %d x accum %d = "
             "%d tokens/step | %d steps | %s", n_params / 1e6, preset.name, plan.world_size, backend.device,
             plan.device_batch, plan.seq_len, plan.world_size, plan.accum, plan.batch_tokens, plan.total_steps,
             plan.layout.describe())
    log.info("\n".join(plan.memory.lines()))
    return metrics, progress


def _log_train(cfg, backend, plan, metrics, window, timer, step, tokens, lr, grad_norm) -> float:
    """One train metrics line: loss, lr, grad norm, tokens/s, MFU, memory, compiles. Returns the loss."""
    loss_avg = window.mean(step)     # computed by the timer's sync below
    rec = timer.lap(step, tokens)
    loss = float(loss_avg)
    window.reset(step)
    rec = {"loss": loss, "lr": lr, "grad_norm": float(grad_norm)} | rec
    peak = get_preset(cfg.train.hardware).peak_flops * plan.world_size
    if peak > 0:
        rec["mfu"] = flops_per_token(cfg.model, plan.seq_len) * rec["tokens_per_s"] / peak
    rec.update(backend.memory_stats())
    compiles = backend.compile_count()
    if compiles is not None:
        rec["compiles"] = compiles
    metrics.log("train", step, tokens, **rec)
    if backend.is_main:
        log.info("step %d/%d | loss %.4f | lr %.2e | gnorm %.3f | %.0f tok/s | %.0f ms/step%s",
                 step, plan.total_steps, loss, lr, rec["grad_norm"], rec["tokens_per_s"], 1000 * rec["step_time_s"],
                 f" | MFU {100 * rec['mfu']:.1f}%" if "mfu" in rec else "")
    return loss


def _log_validation(cfg, backend, plan, metrics, model, token_bytes, step, tokens) -> dict:
    result = validation_loss(cfg, model, backend, plan, token_bytes)
    metrics.log("val", step, tokens, **{k: v for k, v in result.items() if k not in ("tokens", "bytes")},
                val_tokens=result["tokens"])
    if backend.is_main:
        log.info("step %d | val loss %.4f | bits/byte %.4f", step, result["loss"], result["bits_per_byte"])
    return result


def _save(cfg, backend, plan, model, optimizer, loader, metrics, window, step, tokens, reason: str,
          previous) -> PendingSave:
    """Every rank writes its own part (its shards under fsdp); rank 0 the marker, last. Periodic
    saves under train.async_save only copy the state here and write it while training goes on; the
    final and SIGTERM saves (a spot VM gets ~30 s) are synchronous. One save at a time."""
    if previous is not None:
        previous.wait()
    log_window = window.state()      # every rank: the partial loss window is averaged over replicas
    if backend.is_main:
        metrics.flush()   # gs://: every line up to this checkpoint is in the file before it exists
    background = cfg.train.async_save and reason == "periodic"
    saving = save_training(
        cfg, backend.control, model_state=backend.state_dict_for_save(model), model=unwrap(model),
        optimizer=optimizer, loader=loader, step=step, tokens=tokens, log_window=log_window,
        world_size=plan.world_size, batch_tokens=plan.batch_tokens, tokenizer_sha=plan.tokenizer_sha,
        parallel=plan.layout.describe(), background=background)
    if backend.is_main:
        log.info("checkpoint (%s): %s%s", reason, saving.folder, " (writing in the background)" if background else "")
    return saving


def _log_stopped(cfg, backend, plan, stop, step: int, saved_at: int) -> None:
    if not backend.is_main:
        log.info("%sstopped at step %d", rank_tag(backend.control), step)
        return
    log.warning("stopped by %s at step %d/%d; checkpoint saved in %s. Resume: run the same command again "
                "(resume is automatic when a checkpoint exists).", stop.signal_name or "a signal", step,
                plan.total_steps, checkpoint.step_dir(cfg.run, saved_at))


def _summary(plan: Plan, step: int, tokens: int, stopped: bool, loss=None, val=None) -> dict:
    val = val or {}
    return {"step": step, "total_steps": plan.total_steps, "tokens": tokens, "loss": loss,
            "val_loss": val.get("loss"), "val": val, "stopped": stopped, "accum": plan.accum,
            "batch_tokens": plan.batch_tokens, "device_batch": plan.device_batch, "seq_len": plan.seq_len,
            "world_size": plan.world_size}
