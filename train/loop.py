"""The training loop, top to bottom: `train(cfg, evaluate) -> dict`.

    backend -> plan -> model -> optimizer -> loader -> resume
    for step in range(start, total):
        lr; the micro-batches' forward + backward (XLA: one While); THE gradient all-reduce;
        clip; optimizer.step(); log, validate, save when due (and on SIGTERM, and at the end)

`evaluate` is eval/evaluate.py's function, passed in by the caller (`codex train`, the demo) so
that train/ never imports eval/, which sits above it. The batch, the exit paths: docs/training.md.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from codex.core import fsio, rundir
from codex.core.config import Config, ConfigError, save_config, to_dict
from codex.core.progress import Progress, setup_logging
from codex.model.gpt import flops_per_token, num_params
from codex.pipeline.shard.manifest import small_val_split
from codex.train.checkpoint import folders as checkpoint
from codex.train.checkpoint.async_save import BackgroundWriter, PendingSave
from codex.train.checkpoint.resume import resume
from codex.train.checkpoint.state import StepRecord, TrainingParts, restore_training, save_training
from codex.train.data.loader import TrainLoader, val_batches
from codex.train.data.mixture import Mixture, MixtureLoader
from codex.train.data.token_shards import load_manifest
from codex.train.distributed.backend import Backend, loader_layout, unwrap
from codex.train.distributed.control import StopFlag, injected_step_fault, rank_tag
from codex.train.launch import open_backend
from codex.train.metrics import LossWindow, Meters, StepTimer, TrainLine, make_logger
from codex.train.optim.optimizer import clip_grad_norm, make_optimizer
from codex.train.optim.schedule import lr_for, set_lr
from codex.train.plan.plan import Plan, make_plan
from codex.train.plan.presets import HardwarePreset, get_preset
from codex.train.plan.report import memory_lines
from codex.train.plan.save_time import hosts_of, preempt_warning, save_time
from codex.train.remat import apply_remat

log = logging.getLogger("codex.train")

# eval/evaluate.py's evaluate(model, batches, token_bytes, backend=...)
#   -> {"loss", "bits_per_byte", ...}
Evaluate = Callable[..., dict]


@dataclass(frozen=True)
class Run:
    """What every part of the loop reads, fixed once set-up is done."""

    cfg: Config  # resolved: the tokenizer's vocab, the MLP width, the lr filled in
    backend: Backend
    plan: Plan
    preset: HardwarePreset
    evaluate: Evaluate
    token_bytes: torch.Tensor | None  # UTF-8 bytes per token id, for bits per byte
    plot: Callable[[str], object] | None = None  # eval's loss plot, redrawn after each validation


@dataclass
class StepState:
    """What the loop carries from one optimizer step to the next."""

    step: int
    tokens: int
    loss: float | None = None  # the last logged training loss
    val: dict = field(default_factory=dict)  # the last validation result
    saved_at: int = -1  # the step of the newest checkpoint (-1: none yet)
    saving: PendingSave | None = None  # the checkpoint being written (train.async_save)
    writer: BackgroundWriter | None = None  # train.async_save: this rank's writer process

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()  # after an error: abandons a save still in flight


class ManagedGC:
    """train.gc_every > 0: Python's garbage collector off while training (after one full
    collection), generations 0 and 1 collected every `every` steps, so every rank collects at the
    same step; at the end, the collector as it was. torchtitan's GarbageCollection: an automatic
    collection starts at whatever allocation crosses its threshold, at another moment on each
    rank, and the other ranks wait for it at the next collective."""

    def __init__(self, every: int):
        self.every, self.was_enabled = every, gc.isenabled()
        if every > 0:
            gc.disable()
            gc.collect()

    def step(self, step: int) -> None:
        if self.every > 0 and step % self.every == 0:
            gc.collect(1)

    def start_up_done(self) -> None:
        """Start-up (the first step's torch.compile tracing, the first allocations, a checkpoint
        load) leaves many young, long-lived objects: the first steady collection would traverse
        them all, a stall at step gc_every. One full collection now, then gc.freeze() keeps them
        out of every later collection."""
        if self.every > 0:
            gc.collect()
            gc.freeze()

    def close(self) -> None:
        if self.every > 0:
            gc.unfreeze()
            if self.was_enabled:
                gc.enable()


def due(step: int, every: int, total_steps: int) -> bool:
    """True every `every` steps and at the last step; never when every <= 0."""
    return every > 0 and (step % every == 0 or step == total_steps)


def validation_loss(run: Run, model: torch.nn.Module) -> dict:
    """Validation loss / perplexity / bits per byte over the val split (or train.eval_tokens), with
    the same evaluate() as `codex eval`."""
    cfg, backend, plan = run.cfg, run.backend, run.plan
    if run.token_bytes is None:
        raise FileNotFoundError(
            f"{fsio.join(rundir.tokenizer_dir(rundir.data_run(cfg)), 'token_bytes.npy')} "
            "not found: needed for bits per byte; re-run `codex data tokenize`"
        )
    rank, world, rows = loader_layout(backend, plan.device_batch)
    # With several loaders every rank gets the same number of masked batches (val_batches), in
    # every layout: a sharded model all-gathers its weights in every forward, so a rank with no
    # rows left that skipped a batch would wait in the loss all-reduce while another waits in an
    # all-gather, until the collective timeout. XLA wants masked full batches in one process too.
    batches = val_batches(
        rundir.shards_dir(rundir.data_run(cfg)),
        seq_len=plan.seq_len,
        batch_size=rows,
        rank=rank,
        world_size=world,
        max_tokens=cfg.train.eval_tokens,
        with_mask=backend.fixed_shapes,
    )
    # The uncompiled module: validation batches may have another shape than training's.
    return run.evaluate(unwrap(model), batches, run.token_bytes, backend=backend)


# --- the loop ---------------------------------------------------------------------------------


def train(
    cfg: Config,
    evaluate: Evaluate,
    xla_spawned: bool = False,
    plot: Callable[[str], object] | None = None,
) -> dict:
    """Train cfg.model on cfg.run's shards. Returns a summary dict (step, tokens, losses, stopped).
    evaluate: eval/evaluate.py's evaluate, for validation. xla_spawned: this process is one of
    train.xla_mode=spawn's (train/xla/backend.py: spawn_train). plot: eval/plot.py's plot_loss,
    redrawn by the main process after each validation (None: no plot)."""
    setup_logging()
    with open_backend(cfg, xla_spawned=xla_spawned) as backend:
        return _train(cfg, backend, evaluate, plot)


def _train(
    cfg: Config, backend: Backend, evaluate: Evaluate, plot: Callable[[str], object] | None
) -> dict:
    """The loop, top to bottom on purpose (as nanoGPT's train.py): reading it is reading a step."""
    # --- plan, model, optimizer, data ---
    run = _make_run(cfg, backend, evaluate, plot)
    cfg, plan, tcfg = run.cfg, run.plan, run.cfg.train
    model = backend.build_model(cfg.model, tcfg.seed, plan.layout)  # placed (sharded)
    model = apply_remat(model, tcfg.remat, backend.kind)  # train.remat: checkpoint every block
    raw = unwrap(model)  # without a torch.compile wrapper
    optimizer = make_optimizer(raw, tcfg, backend.kind, backend.autocast_dtype)
    parts = TrainingParts(raw, optimizer, _make_loader(run))
    # XLA: the micro-batches and clip + optimizer.step, each traced once; None: Python below
    accumulate = backend.device_accumulation(model, plan.accum)
    update = backend.cached_update(raw, optimizer, tcfg.grad_clip)

    # --- resume: rank 0 picks the newest intact checkpoint, every rank loads exactly it ---
    existing, state, log_window = _resume(run, parts)
    if _nothing_to_do(run, state.step):
        return _summary(plan, state)
    meters = _start_run(run, num_params(raw), state, existing, log_window)
    stop = StopFlag().install()
    model.train()
    first_step = state.step  # this process's first step (0, or the step resumed from)
    collector = ManagedGC(tcfg.gc_every)
    try:
        while state.step < plan.total_steps:
            # --- one optimizer step ---
            injected_step_fault(backend.control, state.step)
            lr = set_lr(optimizer, lr_for(state.step, tcfg, plan.total_steps))
            if accumulate is not None:  # XLA: every micro-batch in one While, traced once
                meters.window.add(accumulate(parts.loader))
            for micro in range(plan.accum if accumulate is None else 0):
                # reduce in the last backward only (fsdp: reduce-scatter; replicate: buckets)
                backend.set_grad_sync(model, micro == plan.accum - 1)
                x, y = backend.to_device(next(parts.loader))
                with backend.autocast():
                    loss = model(x, y)
                # /accum, then all_reduce_grads' mean over ranks: the mean over the step's tokens
                (loss / plan.accum).backward()
                meters.window.add(loss)
            backend.all_reduce_grads(raw)  # THE gradient all-reduce (once per step)
            # clip the global gradient (after the all-reduce), then step; XLA: one traced program
            grad_norm = update(lr) if update is not None else _clip_and_step(parts, tcfg.grad_clip)
            optimizer.zero_grad(set_to_none=True)
            # a log step's mean loss, in this step's program (XLA: read at the next log step)
            logs = due(state.step + 1, tcfg.log_every, plan.total_steps)
            mean_loss = meters.window.take(state.step + 1) if logs else None
            backend.step_boundary()
            state.step += 1
            state.tokens += plan.batch_tokens
            collector.step(state.step)
            meters.progress.update(1)  # steps and ETA only; tokens/s is the metrics line's

            # --- log, validate, save ---
            if mean_loss is not None:
                line = TrainLine(state.step, state.tokens, lr, mean_loss, grad_norm)
                _log_train(run, meters, state, line)
            if due(state.step, tcfg.eval_every, plan.total_steps):
                with _paused(run, meters, state):
                    state.val = _log_validation(run, meters, model, state)
            stopping = backend.any_flag(stop.is_set)  # every rank stops at the same step
            last = state.step == plan.total_steps
            if stopping or last or due(state.step, tcfg.save_every, plan.total_steps):
                reason = "preempted" if stopping else "final" if last else "periodic"
                with _paused(run, meters, state):
                    state.saving = _save(run, meters, parts, state, reason)
                state.saved_at = state.step
            if state.step == first_step + 1:  # start-up is over (load, compile, first step)
                backend.first_step_done()  # collectives: train.dist_timeout_s from here
                collector.start_up_done()
            if stopping:
                break
        if state.saving is not None:
            state.saving.wait()  # the final and SIGTERM saves are synchronous; this is a no-op then
    finally:  # in this order, after an error too
        for close in (collector.close, state.close, stop.restore, parts.loader.close, meters.close):
            close()
    _log_stopped(run, stop, state)
    return _summary(plan, state)


# --- the loop's parts, in the order they run ---------------------------------------------------


def _make_run(
    cfg: Config, backend: Backend, evaluate: Evaluate, plot: Callable[[str], object] | None
) -> Run:
    """The run's plan and its resolved config, once every host has been found to run the same
    command on the same files."""
    preset = get_preset(cfg.train.hardware)
    backend.control.check_same_config(to_dict(cfg))  # every host got the same command and files
    backend.control.check_shared_dir(cfg.run)  # and every rank reads and writes one run folder
    cfg, plan, token_bytes = make_plan(cfg, preset, backend.world_size)
    return Run(cfg, backend, plan, preset, evaluate, token_bytes, plot)


def _make_loader(run: Run) -> TrainLoader:
    # One loader per process; under XLA SPMD it loads the batch of all the host's chips. On CUDA
    # it builds batches in pinned memory and copies them with non_blocking=True.
    cfg, backend = run.cfg, run.backend
    rank, world, rows = loader_layout(backend, run.plan.device_batch)
    options: dict[str, Any] = dict(
        rank=rank,
        world_size=world,
        seed=cfg.train.seed,
        shuffle_shards=cfg.train.shuffle_shards,
        device=backend.pinned_copy_device,
        bos_aligned=cfg.train.bos_aligned,
    )
    shards = rundir.shards_dir(rundir.data_run(cfg))
    if cfg.train.data.mixture:
        per_step = run.plan.batch_tokens // run.plan.seq_len  # the global positions of a step
        mixture = Mixture.from_config(cfg.train.data, per_step)
        return MixtureLoader(shards, run.plan.seq_len, rows, mixture, **options)
    return TrainLoader(shards, seq_len=run.plan.seq_len, batch_size=rows, **options)


def _clip_and_step(parts: TrainingParts, max_norm: float) -> torch.Tensor:
    """Clip the (all-reduced) gradient, then the optimizer step (CPU/CUDA); the norm."""
    grad_norm = clip_grad_norm(parts.model, max_norm)
    parts.optimizer.step()
    return grad_norm


def _resume(run: Run, parts: TrainingParts) -> tuple[int | None, StepState, dict]:
    """(existing checkpoint step or None, the state to go on from, the unfinished loss window);
    automatic when a checkpoint exists (train.resume=auto)."""
    cfg, backend = run.cfg, run.backend
    existing, chosen = resume(backend.control, cfg.run, allow=cfg.train.resume != "never")
    if existing is not None and cfg.train.resume == "never":
        raise ConfigError(
            f"{rundir.checkpoints_dir(cfg.run)} already has checkpoints (up to step {existing}) "
            "and --no-resume was given: use a new --run, or delete that folder to start over"
        )
    if chosen is None:
        return existing, StepState(0, 0), {"loss_sum": 0.0, "since": 0}
    saved = restore_training(cfg, backend.control, chosen, parts, run.plan.tokenizer_sha)
    step, tokens = saved.step, saved.tokens
    if backend.is_main or backend.control.world > 1:
        log.info(
            "%sresumed from step %d (%d tokens) in %s",
            rank_tag(backend.control),
            step,
            tokens,
            rundir.checkpoints_dir(cfg.run),
        )
    plan = run.plan
    changed = saved.batch_tokens not in (0, plan.batch_tokens) or saved.world_size not in (
        0,
        plan.world_size,
    )
    if changed and backend.is_main:
        log.warning(
            "resuming with %d tokens per step on %d ranks; the checkpoint trained with %d on %d: "
            "the schedule goes on by step count (train.max_steps, warmup, decay), so the tokens "
            "seen and the learning rate per token change from here",
            plan.batch_tokens,
            plan.world_size,
            saved.batch_tokens,
            saved.world_size,
        )
    return existing, StepState(step, tokens, saved_at=step), saved.log_window


def _nothing_to_do(run: Run, step: int) -> bool:
    if step < run.plan.total_steps:
        return False
    if run.backend.is_main:
        log.warning(
            "nothing to do: the checkpoint is at step %d and this run ends at step %d; "
            "raise --max-steps (or train.max_tokens) to train further, or use a new --run",
            step,
            run.plan.total_steps,
        )
    return True


def _start_run(
    run: Run, n_params: int, state: StepState, existing: int | None, log_window: dict
) -> Meters:
    """Where the loop's measurements go, the loss window going on from `log_window` (a
    checkpoint's, or empty); the main process logs what this run does and saves its config."""
    cfg, backend, plan = run.cfg, run.backend, run.plan
    step = state.step
    metrics = make_logger(
        cfg,
        backend.is_main,
        resume_step=step if existing is not None else None,
        config_dict=to_dict(cfg)
        | {"n_params": n_params, "accum": plan.accum, "world_size": plan.world_size},
    )
    progress = Progress(
        "train" if step == 0 else f"train (resumed at step {step})",
        total=plan.total_steps - step,
        unit="steps",
        enabled=backend.is_main,
    )
    if backend.is_main:
        _log_start(run, n_params)
    window = LossWindow(backend, plan.accum, log_window)
    return Meters(window, StepTimer(backend, state.step, state.tokens), metrics, progress)


def _log_start(run: Run, n_params: int) -> None:
    """The run's resolved config saved beside its checkpoints, and its start-up lines."""
    cfg, backend, plan = run.cfg, run.backend, run.plan
    if cfg.train.warmup_steps >= plan.total_steps:
        log.warning(
            "train.warmup_steps=%d covers the whole run (%d steps): "
            "the learning rate never reaches train.lr",
            cfg.train.warmup_steps,
            plan.total_steps,
        )
    fsio.makedirs(rundir.checkpoints_dir(cfg.run))
    save_config(cfg, fsio.join(rundir.checkpoints_dir(cfg.run), "config.yaml"))
    log.info(
        "model %.2fM params | %s x%d (%s) | device_batch %d x seq_len %d x world %d x accum %d = "
        "%d tokens/step | %d steps | %s",
        n_params / 1e6,
        run.preset.name,
        plan.world_size,
        _cpu_threads() if backend.kind == "cpu" else backend.device,
        plan.device_batch,
        plan.seq_len,
        plan.world_size,
        plan.accum,
        plan.batch_tokens,
        plan.total_steps,
        plan.layout.describe(),
    )
    log.info("\n".join(memory_lines(plan.memory)))
    save = save_time(
        plan.memory, hosts_of(run.preset, plan.world_size), fsio.is_remote(cfg.run),
        cfg.train.save_rate_gbs,
    )  # fmt: skip
    if late := preempt_warning(save, cfg.train.preempt_notice_s):
        log.warning(late)
    _log_data(cfg)


def _log_data(cfg: Config) -> None:
    """Where the tokenizer and shards come from when another run's (train.data_run), and a warning
    when their validation split is small enough for its loss to move with noise."""
    data = rundir.data_run(cfg)
    if not rundir.same_dir(data, cfg.run):
        log.info("data: the tokenizer and shards of %s (train.data_run)", data)
    small = small_val_split(load_manifest(rundir.shards_dir(data)), rundir.shards_dir(data))
    if small:
        log.warning("%s", small)


def _cpu_threads() -> str:
    n = torch.get_num_threads()  # train/plan/threads.py set it
    return f"cpu, {n} thread{'s' if n != 1 else ''}"


def _log_train(run: Run, meters: Meters, state: StepState, line: TrainLine) -> None:
    """A log step. lagged_logs (XLA): write the previous log step's line, whose values are long
    computed, and keep this one for the next log step (or the next sync: validation, a save, the
    end: _paused), so the host never waits for the device here. Otherwise: this step's line, now."""
    if not run.backend.lagged_logs:
        state.loss = _write_train_line(run, meters, line, state, sync=True)
        return
    previous, meters.pending = meters.pending, line
    if previous is not None:
        state.loss = _write_train_line(run, meters, previous, state, sync=False)


@contextlib.contextmanager
def _paused(run: Run, meters: Meters, state: StepState):
    """A pause of the training clock (validation, a checkpoint), which drains the device: the
    pending lagged line is written first, at no extra cost."""
    if meters.pending is not None:
        line, meters.pending = meters.pending, None
        state.loss = _write_train_line(run, meters, line, state, sync=True)
    with meters.timer.pause():
        yield


def _write_train_line(
    run: Run, meters: Meters, line: TrainLine, state: StepState, sync: bool
) -> float:
    """One train metrics line: loss, lr, grad norm, tokens/s, MFU, memory, compiles. Returns the
    loss. The rates run up to the loop's step (StepTimer.lap): after a sync, or, with sync False
    (lagged), after reading the line's values, which waits for its step only."""
    backend, plan = run.backend, run.plan
    if sync:
        rec = meters.timer.lap(state.step, state.tokens)
    loss, grad_norm = float(line.loss), float(line.grad_norm)
    if not sync:
        rec = meters.timer.lap(state.step, state.tokens, sync=False)
    rec = {"loss": loss, "lr": line.lr, "grad_norm": grad_norm} | rec
    peak = run.preset.peak_flops * plan.world_size
    if peak > 0:
        rec["mfu"] = flops_per_token(run.cfg.model, plan.seq_len) * rec["tokens_per_s"] / peak
    rec.update(backend.memory_stats())
    if "mem_gb" in rec:  # measured against what the memory plan said before the run
        rec["mem_plan_gb"] = plan.memory.total / 1e9
    compiles = backend.compile_count()
    if compiles is not None:
        rec["compiles"] = compiles
    meters.metrics.log("train", line.step, line.tokens, **rec)
    if backend.is_main:
        log.info(
            "step %d/%d | loss %.4f | lr %.2e | gnorm %.3f | %.0f tok/s | %.0f ms/step%s%s",
            line.step,
            plan.total_steps,
            loss,
            line.lr,
            rec["grad_norm"],
            rec["tokens_per_s"],
            1000 * rec["step_time_s"],
            f" | MFU {100 * rec['mfu']:.1f}%" if "mfu" in rec else "",
            _memory_text(rec),
        )
    return loss


def _memory_text(rec: dict) -> str:
    """' | mem 12.1 GB peak / 14.0 planned' where the device reports its memory (CUDA, TPU);
    ' | rss 0.6 GB peak' on the CPU: the process's peak resident memory, which counts the
    interpreter and its libraries too, so it is not set against the plan."""
    if "mem_gb" not in rec:
        return f" | rss {rec['rss_gb']:.1f} GB peak" if "rss_gb" in rec else ""
    used = rec.get("mem_peak_gb", rec["mem_gb"])
    return f" | mem {used:.1f} GB peak / {rec['mem_plan_gb']:.1f} planned"


def _log_validation(run: Run, meters: Meters, model: torch.nn.Module, state: StepState) -> dict:
    result = validation_loss(run, model)
    meters.metrics.log(
        "val",
        state.step,
        state.tokens,
        **{k: v for k, v in result.items() if k not in ("tokens", "bytes")},
        val_tokens=result["tokens"],
    )
    if run.backend.is_main:
        log.info(
            "step %d | val loss %.4f | bits/byte %.4f",
            state.step,
            result["loss"],
            result["bits_per_byte"],
        )
        if run.plot is not None:
            meters.metrics.flush()
            try:
                run.plot(run.cfg.run)
            except Exception as e:  # a plot never stops training
                log.warning("loss plot not drawn (%s: %s)", type(e).__name__, e)
    return result


def _save(
    run: Run, meters: Meters, parts: TrainingParts, state: StepState, reason: str
) -> PendingSave:
    """Every rank writes its own part (its shards under fsdp); rank 0 the marker, last. Periodic
    saves under train.async_save only copy the state here and write it while training goes on; the
    final and SIGTERM saves (a spot VM gets ~30 s) are synchronous. One save at a time."""
    cfg, backend, plan = run.cfg, run.backend, run.plan
    if state.saving is not None:
        try:
            state.saving.wait()
        except Exception:
            if reason == "periodic":
                raise
            # the final or SIGTERM save still runs: it is the only way to keep the steps since the
            # last good checkpoint (every rank goes on to it, whichever ranks' writers failed)
            log.exception(
                "the background save of %s failed; saving synchronously now", state.saving.folder
            )
        state.saving = None
    # every rank: the partial loss window is averaged over replicas
    log_window = meters.window.state()
    if backend.is_main:
        # gs://: every line up to this checkpoint is in the file before it exists
        meters.metrics.flush()
    background = cfg.train.async_save and reason == "periodic"
    if background and state.writer is None:
        state.writer = BackgroundWriter(backend.control)
    record = StepRecord(
        step=state.step,
        tokens=state.tokens,
        log_window=log_window,
        world_size=plan.world_size,
        batch_tokens=plan.batch_tokens,
        tokenizer_sha=plan.tokenizer_sha,
        parallel=plan.layout.describe(),
    )
    writer = state.writer if background else None
    saving = save_training(cfg, backend.control, parts, record, writer=writer)
    if backend.is_main:
        log.info(
            "checkpoint (%s): %s%s",
            reason,
            saving.folder,
            " (writing in the background)" if background else "",
        )
    return saving


def _log_stopped(run: Run, stop: StopFlag, state: StepState) -> None:
    """A run stopped before its last step (a signal) says so, and how to resume."""
    if state.step >= run.plan.total_steps:
        return
    if not run.backend.is_main:
        log.info("%sstopped at step %d", rank_tag(run.backend.control), state.step)
        return
    log.warning(
        "stopped by %s at step %d/%d; checkpoint saved in %s. Resume: run the same command again "
        "(resume is automatic when a checkpoint exists).",
        stop.signal_name or "a signal",
        state.step,
        run.plan.total_steps,
        checkpoint.step_dir(run.cfg.run, state.saved_at),
    )


def _summary(plan: Plan, state: StepState) -> dict:
    return {
        "step": state.step,
        "total_steps": plan.total_steps,
        "tokens": state.tokens,
        "loss": state.loss,
        "val_loss": state.val.get("loss"),
        "val": state.val,
        "stopped": state.step < plan.total_steps,
        "accum": plan.accum,
        "batch_tokens": plan.batch_tokens,
        "device_batch": plan.device_batch,
        "seq_len": plan.seq_len,
        "world_size": plan.world_size,
    }
