"""The training loop, top to bottom: `train(cfg) -> dict`.

    backend -> tokenizer meta (vocab size) -> model -> optimizer -> loader -> resume
    for step in range(start, total):
        lr = lr_for(step)
        for micro-batch in range(accum):           # no communication here
            loss = model(x, y) / accum; loss.backward()
        backend.all_reduce_grads(model)            # THE gradient all-reduce, once per step
        clip (on the all-reduced gradient); optimizer.step(); backend.step_boundary()
        every log_every: sync, tokens/s, MFU, memory  every eval_every: val loss + bits per byte
        every save_every (and on SIGTERM/SIGINT and at the end): checkpoint

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
import os
import signal
import time

import numpy as np
import torch

import codex
from codex import fsio, rundir
from codex.config import ConfigError, save_config, to_dict
from codex.progress import Progress, setup_logging
from train import checkpoint
from train.backend import loader_layout, make_backend, replica_mean, unwrap
from train.control import resume
from train.hardware import device_defaults, get_preset
from train.memory import check_fits
from train.metrics import make_logger
from train.optim import load_optimizer_state, lr_for, make_optimizer

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


def resolve_batch(cfg, preset, world_size: int) -> tuple[int, int, int, int]:
    """(device_batch, seq_len, accum, batch_tokens) from train.* and the hardware preset defaults."""
    B, T = cfg.train.device_batch, cfg.train.seq_len
    if B <= 0 or T <= 0:
        dB, dT = device_defaults(preset, cfg.model)
        B = B if B > 0 else dB
        T = T if T > 0 else dT
    if T > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len={T} is longer than model.max_seq_len={cfg.model.max_seq_len}; "
                          f"lower --seq-len or --set model.max_seq_len={T}")
    bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and preset.kind != "cpu")
    check_fits(cfg.model, B, T, preset.kind, preset.memory_gb, act_bytes=2 if bf16 else 4)
    accum = grad_accum_steps(cfg.train.batch_tokens, B, T, world_size)
    return B, T, accum, B * T * world_size * accum


# --- run inputs -------------------------------------------------------------------------------

def _read_vocab(cfg) -> tuple[int, torch.Tensor | None, str]:
    """Vocab size from the run's tokenizer meta (checked against the shard manifest), token_bytes
    for bits per byte (None when absent; validation then says what is missing), and the tokenizer's
    sha256 (recorded in checkpoints, so eval and sample can refuse a retrained tokenizer)."""
    from pipeline.tokenizer import TOKEN_BYTES_FILE, load_meta, load_token_bytes
    from train.loader import load_manifest

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


def _make_loader(cfg, backend, B: int, T: int):
    from train.loader import TrainLoader

    # On CUDA the loader builds batches in pinned memory and copies them with non_blocking=True.
    # One loader per process; under XLA SPMD it loads the batch of all the host's chips.
    rank, world, rows = loader_layout(backend, B)
    return TrainLoader(rundir.shards_dir(cfg.run), seq_len=T, batch_size=rows, rank=rank,
                       world_size=world, seed=cfg.train.seed, shuffle_shards=cfg.train.shuffle_shards,
                       device=backend.device if backend.device.type == "cuda" else None)


def _val_iter(cfg, backend, B: int, T: int):
    from train.loader import val_batches

    rank, world, rows = loader_layout(backend, B)
    return val_batches(rundir.shards_dir(cfg.run), seq_len=T, batch_size=rows, rank=rank, world_size=world,
                       max_tokens=cfg.train.eval_tokens, with_mask=getattr(backend, "fixed_shapes", False))


def validate(cfg, model, backend, B: int, T: int, token_bytes) -> dict:
    """Validation loss / perplexity / bits per byte over the val split (or train.eval_tokens)."""
    from eval.evaluate import evaluate

    if token_bytes is None:
        raise FileNotFoundError(f"{fsio.join(rundir.tokenizer_dir(cfg.run), 'token_bytes.npy')} not found: "
                                "needed for bits per byte; re-run `codex data tokenize`")
    # The uncompiled module: validation batches may have another shape than training's.
    return evaluate(unwrap(model), _val_iter(cfg, backend, B, T), token_bytes, backend=backend)


# --- preemption -------------------------------------------------------------------------------

class StopFlag:
    """Set by SIGTERM/SIGINT; the loop finishes the current step, saves and returns."""

    def __init__(self):
        self.signal_name: str | None = None
        self._old = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a notebook worker)
                pass

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: finishing this step, then saving a checkpoint", self.signal_name)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


# --- the loop ---------------------------------------------------------------------------------

def train(cfg) -> dict:
    """Train cfg.model on cfg.run's shards. Returns a summary dict (step, tokens, losses, stopped)."""
    setup_logging()
    backend = make_backend(cfg)
    ok = False
    try:
        out = _train(cfg, backend)
        ok = True
        return out
    finally:
        backend.close(ok)   # the clean-exit barrier only on success: a failed rank must not wait for its peers


def _train(cfg, backend) -> dict:
    # Long on purpose for now: the loop reads top to bottom (set-up, resume, the step, when to log,
    # validate and save); splitting it into a plan, a timer and checkpoint-owned state is issue 15.
    tcfg = cfg.train
    preset = get_preset(tcfg.hardware)
    W = backend.world_size
    main = backend.is_main

    backend.control.check_same_config(to_dict(cfg))   # every host got the same command and files
    vocab, token_bytes, tokenizer_sha = _read_vocab(cfg)
    cfg.model.vocab_size = vocab
    B, T, accum, batch_tokens = resolve_batch(cfg, preset, W)
    total_steps = math.ceil(tcfg.max_tokens / batch_tokens) if tcfg.max_tokens > 0 else tcfg.max_steps
    if total_steps <= 0:
        raise ConfigError("train.max_steps (or train.max_tokens) must be positive")

    from model.gpt import build_model, flops_per_token, num_params

    model = build_model(cfg.model, seed=tcfg.seed)  # same seed on every rank: identical weights
    n_params = num_params(model)
    model = backend.prepare_model(model)
    raw = unwrap(model)
    optimizer = make_optimizer(raw, tcfg, backend.device.type)
    loader = _make_loader(cfg, backend, B, T)

    # Resume: automatic when a checkpoint exists (train.resume=auto).
    step, tokens = 0, 0
    log_window = {"loss_sum": 0.0, "since": 0}   # the training-loss average in progress (exact resume)
    # Rank 0 picks the step (the newest intact checkpoint) and every rank loads exactly it, or all fail.
    existing, state = resume(backend.control, cfg.run, allow=tcfg.resume != "never")
    if existing is not None and tcfg.resume == "never":
        raise ConfigError(f"{rundir.checkpoints_dir(cfg.run)} already has checkpoints (up to step {existing}) and "
                          "--no-resume was given: use a new --run, or delete that folder to start over")
    if state is not None:
        step, tokens, log_window = _restore(cfg, state, raw, optimizer, loader)
        del state
        if main or W > 1:
            log.info("%sresumed from step %d (%d tokens) in %s", _rank_tag(backend), step, tokens,
                     rundir.checkpoints_dir(cfg.run))

    if step >= total_steps:
        if main:
            log.warning("nothing to do: the checkpoint is at step %d and this run ends at step %d; raise --max-steps "
                        "(or train.max_tokens) to train further, or use a new --run", step, total_steps)
        return _summary(step, total_steps, tokens, None, None, {}, False, accum, batch_tokens, B, T, W)
    if tcfg.warmup_steps >= total_steps and main:
        log.warning("train.warmup_steps=%d covers the whole run (%d steps): the learning rate never reaches train.lr",
                    tcfg.warmup_steps, total_steps)

    if main:
        fsio.makedirs(rundir.checkpoints_dir(cfg.run))
        save_config(cfg, fsio.join(rundir.checkpoints_dir(cfg.run), "config.yaml"))
        log.info("model %.2fM params | %s x%d (%s) | device_batch %d x seq_len %d x world %d x accum %d = "
                 "%d tokens/step | %d steps", n_params / 1e6, preset.name, W, backend.device, B, T, W, accum,
                 batch_tokens, total_steps)
    metrics = make_logger(cfg, main, resume_step=step if existing is not None else None,
                          config_dict=to_dict(cfg) | {"n_params": n_params, "accum": accum, "world_size": W})
    flops_tok = flops_per_token(cfg.model, T)
    peak = preset.peak_flops * W

    def save(reason: str) -> str:
        folder = ""
        # Every rank takes part: the partial loss window is averaged over replicas.
        window = {"loss_sum": float(replica_mean(backend, loss_sum)), "since": loss_since}
        if main:
            state = {
                "model": backend.state_dict_for_save(model), "optimizer": _to_cpu(optimizer.state_dict()),
                "step": step, "tokens": tokens, "loader": loader.state_dict(), "rng": checkpoint.rng_state(),
                "config": to_dict(cfg), "codex_version": codex.__version__,
                "world_size": W, "batch_tokens": batch_tokens, "tokenizer_sha256": tokenizer_sha,
                "log_window": window,
            }
            metrics.flush()   # gs://: every line up to this checkpoint is in the file before it exists
            folder = checkpoint.save(cfg.run, state, keep_last=tcfg.keep_last, keep_every=tcfg.keep_every)
            log.info("checkpoint (%s): %s", reason, folder)
        backend.barrier()
        return folder

    stop = StopFlag()
    stop.install()
    model.train()
    last_loss = last_val = None
    val_result: dict = {}
    saved_at = step if existing is not None else -1
    progress = Progress("train" if step == 0 else f"train (resumed at step {step})", total=total_steps - step,
                        unit="steps", enabled=main)
    # A host-to-device copy, not a computation: on XLA it adds no program to compile, fresh or resumed
    # (a resumed run carries the fp32 sum of its unfinished log window).
    loss_sum = torch.tensor(float(log_window["loss_sum"]), dtype=torch.float32).to(backend.device)
    loss_since = int(log_window["since"])    # first step of the loss average (may precede the resume)
    backend.synchronize()
    t_log, tokens_at_log, steps_at_log, t_excluded = time.perf_counter(), tokens, step, 0.0
    try:
        while step < total_steps:
            _injected_fault(backend, step)
            lr = lr_for(step, tcfg, total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for _ in range(accum):
                x, y = backend.to_device(next(loader))
                with backend.autocast():
                    loss = model(x, y)
                # Mean over the step's tokens: each micro-batch has B*T tokens, so /accum here
                # and the average over ranks in all_reduce_grads give the global token mean.
                (loss / accum).backward()
                loss_sum += loss.detach()
            backend.all_reduce_grads(raw)            # THE gradient all-reduce (once per step)
            # Clip the global gradient, i.e. after the all-reduce (inf = measure only).
            grad_norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), tcfg.grad_clip if tcfg.grad_clip > 0
                                                       else float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            backend.step_boundary()
            step += 1
            tokens += batch_tokens
            progress.update(1, tokens=batch_tokens)

            if step % tcfg.log_every == 0 or step == total_steps:
                # The loss sum is the only cross-rank transfer on logging steps.
                loss_avg = replica_mean(backend, loss_sum) / (accum * (step - loss_since))
                backend.synchronize()  # tokens/s only after the device has really finished
                now = time.perf_counter()
                wall = now - t_log     # since the last log line's clock: logging, eval and saves included
                dt = wall - t_excluded  # training time: validation and checkpoint pauses left out
                tok_s = (tokens - tokens_at_log) / dt
                last_loss = float(loss_avg)
                loss_sum.zero_()
                loss_since = step
                backend.synchronize()  # XLA: the zeroing runs now (its own program), the next step stays the usual one
                rec = {"loss": last_loss, "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": tok_s,
                       "tokens_per_s_wall": (tokens - tokens_at_log) / wall, "step_time_s": dt / (step - steps_at_log)}
                if peak > 0:
                    rec["mfu"] = flops_tok * tok_s / peak
                rec.update(backend.memory_stats())
                compiles = backend.compile_count()
                if compiles is not None:
                    rec["compiles"] = compiles
                metrics.log("train", step, tokens, **rec)
                if main:
                    log.info("step %d/%d | loss %.4f | lr %.2e | gnorm %.3f | %.0f tok/s | %.0f ms/step%s",
                             step, total_steps, last_loss, lr, rec["grad_norm"], tok_s, 1000 * rec["step_time_s"],
                             f" | MFU {100 * rec['mfu']:.1f}%" if "mfu" in rec else "")
                # The next window starts at this line's clock, so logging itself is counted in it.
                t_log, tokens_at_log, steps_at_log, t_excluded = now, tokens, step, 0.0

            if tcfg.eval_every > 0 and (step % tcfg.eval_every == 0 or step == total_steps):
                backend.synchronize()
                t_pause = time.perf_counter()
                val_result = validate(cfg, model, backend, B, T, token_bytes)
                last_val = val_result["loss"]
                metrics.log("val", step, tokens, **{k: v for k, v in val_result.items() if k not in ("tokens", "bytes")},
                            val_tokens=val_result["tokens"])
                if main:
                    log.info("step %d | val loss %.4f | bits/byte %.4f", step, last_val, val_result["bits_per_byte"])
                backend.synchronize()
                t_excluded += time.perf_counter() - t_pause

            stopping = _should_stop(stop, backend)
            if stopping or step == total_steps or (tcfg.save_every > 0 and step % tcfg.save_every == 0):
                backend.synchronize()
                t_pause = time.perf_counter()
                save("preempted" if stopping else "final" if step == total_steps else "periodic")
                saved_at = step
                backend.synchronize()
                t_excluded += time.perf_counter() - t_pause
            if stopping:
                break
    finally:
        stop.restore()
        loader.close()
        progress.close()
        metrics.close()

    stopped = step < total_steps
    if stopped and not main:
        log.info("%sstopped at step %d", _rank_tag(backend), step)
    if stopped and main:
        log.warning("stopped by %s at step %d/%d; checkpoint saved in %s. Resume: run the same command again "
                    "(resume is automatic when a checkpoint exists).", stop.signal_name or "a signal", step,
                    total_steps, checkpoint.step_dir(cfg.run, saved_at))
    return _summary(step, total_steps, tokens, last_loss, last_val, val_result, stopped, accum, batch_tokens, B, T, W)


def _restore(cfg, state: dict, model, optimizer, loader) -> tuple[int, int, dict]:
    """Load a checkpoint's training state into the model, optimizer, loader and RNGs; returns
    (step, tokens, the unfinished log window). The model must be the one the checkpoint was saved from."""
    saved_model = state["config"].get("model", {})
    for k, v in to_dict(cfg.model).items():
        if k != "preset" and k in saved_model and saved_model[k] != v:   # the preset is a name, not the model
            raise ConfigError(f"model.{k}={v!r} differs from the checkpoint's {saved_model[k]!r} "
                              f"({rundir.checkpoints_dir(cfg.run)}); resume with the same model or use a new --run")
    model.load_state_dict(state["model"])
    load_optimizer_state(optimizer, state["optimizer"])
    loader.load_state_dict(state["loader"])
    checkpoint.set_rng_state(state["rng"])
    step = int(state["step"])
    return step, int(state["tokens"]), state.get("log_window") or {"loss_sum": 0.0, "since": step}


def _summary(step, total_steps, tokens, loss, val_loss, val, stopped, accum, batch_tokens, B, T, W) -> dict:
    return {"step": step, "total_steps": total_steps, "tokens": tokens, "loss": loss, "val_loss": val_loss,
            "val": val, "stopped": stopped, "accum": accum, "batch_tokens": batch_tokens,
            "device_batch": B, "seq_len": T, "world_size": W}


def _to_cpu(obj):
    """Optimizer state with every tensor on the CPU, so a checkpoint loads on any device."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _should_stop(stop: StopFlag, backend) -> bool:
    """True on every rank when any rank got SIGTERM/SIGINT (ranks must stop at the same step)."""
    return backend.any_flag(stop.signal_name is not None)


def _rank_tag(backend) -> str:
    """"rank r/n: " for per-rank log lines of a multi-process job ("" on one process)."""
    n = backend.control.world
    return f"rank {backend.control.rank}/{n}: " if n > 1 else ""


FAULT_ENV = "CODEX_TEST_RAISE_AT"   # "RANK:STEP": that control-plane rank raises before that step (tests)


def _injected_fault(backend, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{backend.control.rank}:{step}":
        raise RuntimeError(f"{FAULT_ENV}={spec}: injected failure on rank {backend.control.rank} at step {step}")
