"""The `codex` command line. Each command builds the typed Config and calls one stage function.

Every command takes `--run DIR` (local or gs://), `--config FILE` and repeated `--set key=value`;
its own flags are shortcuts for config keys (`--workers 4` is `--set data.clean.workers=4`).
User mistakes (unknown key, bad value, missing input) exit 2 with one clear line, no traceback.
"""

from __future__ import annotations

import functools
import os
import sys

import click

from codex.config import ConfigError, build_config
from codex.progress import setup_logging


class UserError(click.UsageError):
    """Exit 2 with one line."""


def stage(fn):
    """Run a command body so that the user sees one clear line, never a traceback, for:

    - a usage mistake (ConfigError: unknown key, bad value, hardware mismatch; missing input
      file): exit 2, as Click does for its own usage errors;
    - bad input data or a failed stage (ValueError, OSError, the stages' own errors, which name
      the file, line or key): exit 1.
    Set CODEX_DEBUG=1 to get the traceback instead.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if os.environ.get("CODEX_DEBUG"):
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except (ConfigError, FileNotFoundError) as e:
            raise UserError(_one_line(e)) from None
        except (ValueError, OSError, RuntimeError) as e:
            raise click.ClickException(f"{_one_line(e)}  (CODEX_DEBUG=1 shows the traceback)") from None

    return wrapper


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _run_lock(cfg, command: str):
    """Hold RUN's lease (codex/runlock.py) while a command writes it; a second writer exits 2.
    The tasks of a `data clean` job array write RUN/clean together: each holds a lease of its own."""
    from codex import runlock

    c = cfg.data.clean
    if command == "codex data clean" and c.num_tasks > 1:
        return runlock.hold(cfg.run, f"{command} (task {c.task_index})",
                            lease_name=f".codex-lock.clean-task-{c.task_index:05d}.json")
    return runlock.hold(cfg.run, command, hardware=cfg.train.hardware if command == "codex train" else None)


def config_options(fn):
    """--run, --config, --set: shared by every command that builds a Config."""
    fn = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                      help="Override one config key, e.g. --set model.n_layer=6 (repeatable).")(fn)
    fn = click.option("--config", "config_file", type=str, default=None, metavar="FILE",
                      help="YAML config (see configs/runs/).")(fn)
    fn = click.option("--run", type=str, default=None, metavar="DIR",
                      help="Run directory, local path or gs://bucket/run (default: runs/default).")(fn)
    return fn


def make_config(run, config_file, overrides, flags: dict | None = None, model: str | None = None):
    """Build the Config: the typed option values (None = not given) before the --set ones."""
    return build_config(config_file, overrides, model=model, run=run, values=flags)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="codex")
def cli():
    """codex: raw text to a trained, evaluated language model, on TPUs, GPUs or a laptop.

    \b
    Try it end to end on the Python standard library's sources (no download):
      codex demo
    \b
    The stages, chained by one run directory:
      codex data clean --run runs/my --input 'data/*.jsonl'
      codex data tokenize --run runs/my
      codex data shard --run runs/my
      codex train --run runs/my --hardware v6e-4 --model 124m
      codex eval --run runs/my
    """
    setup_logging()


@cli.group()
def data():
    """Data stages: clean -> tokenize -> shard (and verify, upload)."""


# --- codex data clean -------------------------------------------------------------------------

@data.command("clean")
@config_options
@click.option("--input", "inputs", multiple=True, metavar="PATH",
              help="Input file, glob or directory (.txt, .jsonl[.gz|.zst], .parquet), local or gs:// (repeatable).")
@click.option("--workers", type=int, default=None, help="Processes on this machine.")
@click.option("--num-tasks", type=int, default=None, help="Split input files across N tasks (a job array).")
@click.option("--task-index", type=int, default=None, help="Which task this process runs (0..N-1).")
@click.option("--text-field", default=None, help="JSONL field holding the text (default: text).")
@click.option("--text-column", default=None, help="Parquet column holding the text (default: text).")
@click.option("--txt-delimiter", default=None, metavar="TEXT",
              help="Split text files (.txt, .md, ...) into documents on TEXT, e.g. '\\n\\n' for blank lines "
                   "(escapes such as \\n are understood). Default: a whole text file is one document, and one over "
                   "1 MB (data.clean.length.max_chars) is dropped.")
@click.option("--preset", type=click.Choice(["web", "code"]), default=None, help="Filter preset.")
@click.option("--keep-rejected/--no-keep-rejected", default=None, help="Also write dropped documents with their reason.")
@stage
def data_clean(run, config_file, overrides, inputs, workers, num_tasks, task_index, text_field, text_column,
               txt_delimiter, preset, keep_rejected):
    """Clean raw text into parquet shards under RUN/clean/.

    \b
    Example:
      codex data clean --run runs/web --input 'raw/*.jsonl.zst' --workers 2
      codex data clean --run gs://bucket/run --input gs://bucket/raw --num-tasks 8 --task-index 3
      codex data clean --run runs/book --input book.txt --txt-delimiter '\\n\\n'
    """
    cfg = make_config(run, config_file, overrides, {
        "data.clean.inputs": list(inputs) if inputs else None, "data.clean.workers": workers,
        "data.clean.num_tasks": num_tasks, "data.clean.task_index": task_index,
        "data.clean.text_field": text_field, "data.clean.text_column": text_column,
        "data.clean.txt_delimiter": txt_delimiter, "data.clean.preset": preset, "data.clean.keep_rejected": keep_rejected})
    if not cfg.data.clean.inputs:
        raise UserError("no input: pass --input PATH (or set data.clean.inputs in --config)")
    from pipeline.clean import run_clean

    with _run_lock(cfg, "codex data clean"):
        run_clean(cfg)


# --- codex data tokenize ----------------------------------------------------------------------

@data.command("tokenize")
@config_options
@click.option("--vocab-size", type=int, default=None, help="Vocabulary size (default 32768).")
@click.option("--max-chars", type=int, default=None, help="Characters of training text to use.")
@click.option("--doc-max-chars", type=int, default=None, help="Use at most this many characters of each document.")
@click.option("--trainer", type=click.Choice(["rustbpe", "hf"]), default=None,
              help="BPE trainer: rustbpe (default, faster) or hf (HF tokenizers' BpeTrainer; for over 2 GB of text).")
@click.option("--input", "inputs", multiple=True, metavar="PATH",
              help="Train on these files, globs or directories (.parquet 'text' column, .jsonl[.gz|.zst] 'text' "
                   "field, .txt = one document) instead of RUN/clean/ (repeatable).")
@stage
def data_tokenize(run, config_file, overrides, vocab_size, max_chars, doc_max_chars, trainer, inputs):
    """Train a byte-level BPE tokenizer on the cleaned text; writes RUN/tokenizer/.

    Documents are sampled by a hash of their text (smallest hashes until --max-chars), so the
    result does not depend on how many shard files exist or their order. Either trainer writes
    the same kind of HF tokenizer.json.

    \b
    Example:
      codex data tokenize --run runs/web --vocab-size 32768
      codex data tokenize --run runs/web --vocab-size 65536 --max-chars 1000000000
      codex data tokenize --run runs/web --max-chars 4000000000 --trainer hf
    """

    cfg = make_config(run, config_file, overrides, {
        "data.tokenizer.vocab_size": vocab_size, "data.tokenizer.max_chars": max_chars,
        "data.tokenizer.doc_max_chars": doc_max_chars, "data.tokenizer.trainer": trainer,
        "data.tokenizer.inputs": list(inputs) if inputs else None})
    from pipeline.tokenizer import run_tokenizer

    with _run_lock(cfg, "codex data tokenize"):
        run_tokenizer(cfg)


# --- codex data shard / verify / upload ---------------------------------------------------------

@data.command("shard")
@config_options
@click.option("--out", default=None, help="Where to write shards (default RUN/shards; any fsspec URL, e.g. gs://b/run/shards).")
@click.option("--shard-tokens", type=int, default=None, help="Tokens per shard.")
@click.option("--val-fraction", type=float, default=None, help="Fraction of documents in the validation split.")
@click.option("--format", "fmt", type=click.Choice(["npy", "parquet", "both"]), default=None, help="Shard format.")
@click.option("--workers", type=int, default=None, help="Worker processes.")
@stage
def data_shard(run, config_file, overrides, out, shard_tokens, val_fraction, fmt, workers):
    """Tokenize the cleaned corpus into fixed-size token shards + manifest.json.

    \b
    Example:
      codex data shard --run runs/web --shard-tokens 50000000 --workers 2
      codex data shard --run runs/web --out gs://bucket/web/shards
    """

    cfg = make_config(run, config_file, overrides, {
        "data.shard.out": out, "data.shard.shard_tokens": shard_tokens, "data.shard.val_fraction": val_fraction,
        "data.shard.format": fmt, "data.shard.workers": workers})
    from pipeline.shard import run_shard

    with _run_lock(cfg, "codex data shard"):
        run_shard(cfg)


@data.command("verify")
@click.argument("run_dir", metavar="RUN", required=False)
@config_options
@click.option("--out", default=None, help="The shards folder to check (default RUN/shards).")
@stage
def data_verify(run_dir, run, config_file, overrides, out):
    """Check every shard against RUN/shards/manifest.json (sha256, dtype, counts, tokenizer).

    \b
    Example:
      codex data verify runs/web
      codex data verify gs://bucket/web
    """
    if run_dir and run and run_dir.rstrip("/") != run.rstrip("/"):
        raise UserError(f"two run directories: RUN={run_dir} and --run {run}; give one")
    cfg = make_config(run_dir or run, config_file, overrides, {"data.shard.out": out})
    from codex import rundir
    from pipeline.shard import verify_shards

    shards = cfg.data.shard.out or rundir.shards_dir(cfg.run)
    problems = verify_shards(shards, rundir.tokenizer_dir(cfg.run))
    for p in problems:
        click.echo(p, err=True)
    if problems:
        raise click.ClickException(f"{len(problems)} problem(s) in {shards}")
    click.echo(f"{shards}: every shard matches manifest.json")


@data.command("upload")
@click.argument("local_run", metavar="LOCAL_RUN")
@click.argument("remote", metavar="REMOTE")
@stage
def data_upload(local_run, remote):
    """Copy a local run directory to gs:// (any fsspec URL), verifying each object's size and checksum.

    A rerun resumes: objects that already match are skipped, differing ones are re-uploaded.

    \b
    Example:
      codex data upload runs/web gs://bucket/web
    """
    from codex import runlock
    from pipeline.upload import upload_run

    with runlock.hold(remote, "codex data upload"):
        r = upload_run(local_run, remote)
    click.echo(f"{r['files']} files ({r['uploaded']} uploaded, {r['skipped']} already there), "
               f"all verified ({', '.join(r['checksum'])}) -> {remote}")


# --- codex train --------------------------------------------------------------------------------

@cli.command("train")
@config_options
@click.option("--hardware", default=None, help="Hardware preset: cpu, h100, h100-8, v6e-4, ... (see `codex hardware`).")
@click.option("--model", default=None, help="Model size preset: tiny, 124m, 350m, 1b (configs/model/).")
@click.option("--max-steps", type=int, default=None, help="Optimizer steps to train.")
@click.option("--batch-tokens", type=int, default=None, help="Tokens per optimizer step (grad accumulation is derived).")
@click.option("--device-batch", type=int, default=None, help="Sequences per device per micro-batch.")
@click.option("--seq-len", type=int, default=None, help="Sequence length.")
@click.option("--save-every", type=int, default=None, help="Checkpoint every N steps.")
@click.option("--wandb", type=click.Choice(["auto", "online", "offline", "off"]), default=None, help="Weights & Biases logging.")
@click.option("--resume/--no-resume", default=None, help="Resume from the latest checkpoint (default: when one exists).")
@click.option("--xla-mode", type=click.Choice(["spmd", "spawn"]), default=None,
              help="TPU: spmd (default, one process per host) or spawn (one process per chip).")
@click.option("--xla-cache", default=None, metavar="DIR", help="TPU: persistent compilation cache (default RUN/xla_cache).")
@click.option("--max-compiles", type=int, default=None, help="TPU: fail when XLA compiles more programs than this.")
@click.option("--allow-cpu-xla", is_flag=True, default=None,
              help="Run a TPU preset on the XLA CPU backend (PJRT_DEVICE=CPU; tests only).")
@stage
def train_cmd(run, config_file, overrides, hardware, model, max_steps, batch_tokens, device_batch, seq_len,
              save_every, wandb, resume, xla_mode, xla_cache, max_compiles, allow_cpu_xla):
    """Train a model on RUN/shards; checkpoints in RUN/checkpoints, metrics in RUN/metrics.jsonl.

    \b
    Example:
      codex train --run runs/web --hardware h100-8 --model 124m --batch-tokens 524288
      torchrun --nproc_per_node=8 -m train -- --run runs/web --hardware h100-8 --model 124m
      PJRT_DEVICE=TPU codex train --run gs://bucket/web --hardware v6e-4 --model 124m
    """

    cfg = make_config(run, config_file, overrides, {
        "train.hardware": hardware, "train.max_steps": max_steps, "train.batch_tokens": batch_tokens,
        "train.device_batch": device_batch, "train.seq_len": seq_len, "train.save_every": save_every,
        "train.wandb": wandb, "train.resume": None if resume is None else ("auto" if resume else "never"),
        "train.xla_mode": xla_mode, "train.xla_cache": xla_cache, "train.max_compiles": max_compiles,
        "train.allow_cpu_xla": allow_cpu_xla},
        model=model)
    from train.hardware import get_preset, require_shared_run_dir, set_xla_import_env

    require_shared_run_dir(cfg)   # a multi-host slice on a local path: refused before any host writes
    if get_preset(cfg.train.hardware).kind == "tpu":
        set_xla_import_env()      # before the run lock, whose TPU worker-id lookup imports torch_xla
    with _run_lock(cfg, "codex train"):  # before importing torch: a second trainer is refused at once
        if cfg.train.xla_mode == "spawn":  # TPU: one process per chip through torch_xla's launcher
            from train.xla_backend import spawn_train

            spawn_train(cfg)
        else:
            from train.loop import train

            train(cfg)


# --- codex eval ---------------------------------------------------------------------------------

@cli.command("eval")
@config_options
@click.option("--checkpoint", default=None, help="Checkpoint step or 'latest'.")
@click.option("--max-tokens", type=int, default=None, help="Evaluate at most this many tokens (0 = all).")
@click.option("--data", "data_paths", multiple=True, metavar="PATH", help="Evaluate on other text instead of the validation split.")
@click.option("--hardware", default=None, help="Where to evaluate (a preset, `codex hardware`; default cpu).")
@click.option("--device-batch", type=int, default=None, help="Sequences per device per batch (default: the preset's).")
@stage
def eval_cmd(run, config_file, overrides, checkpoint, max_tokens, data_paths, hardware, device_batch):
    """Validation loss, perplexity and bits per byte of a checkpoint; writes RUN/eval/step_N.json
    (and RUN/eval/loss.png from the training metrics).

    \b
    Example:
      codex eval --run runs/web
      codex eval --run runs/web --checkpoint 2000 --data 'heldout/*.txt'
      torchrun --nproc_per_node=8 -m codex.cli eval --run runs/web --hardware h100-8
    """

    cfg = make_config(run, config_file, overrides, {
        "eval.checkpoint": checkpoint, "eval.max_tokens": max_tokens,
        "eval.data": list(data_paths) if data_paths else None, "train.hardware": hardware,
        "eval.device_batch": device_batch})
    import contextlib

    from codex import fsio, rundir, runlock
    from eval.evaluate import run_eval

    # eval writes only RUN/eval, so its lease lives there and it runs beside a trainer; a RUN that
    # does not exist gets no folder made (run_eval says what is missing)
    lock = (runlock.hold(rundir.eval_dir(cfg.run), "codex eval", hardware=cfg.train.hardware)
            if fsio.isdir(cfg.run) else contextlib.nullcontext())
    with lock:
        run_eval(cfg)


@cli.command("sample")
@config_options
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--checkpoint", default=None, help="Checkpoint step or 'latest'.")
@click.option("--max-new-tokens", type=int, default=None, help="Tokens to generate (default 200).")
@click.option("--temperature", type=float, default=None, help="Sampling temperature; 0 = greedy (default 0.8).")
@click.option("--top-k", type=int, default=None, help="Sample among the k most likely tokens; 0 = all (default 50).")
@click.option("--seed", type=int, default=None, help="Random seed: the same seed gives the same text.")
@stage
def sample_cmd(run, config_file, overrides, prompt, checkpoint, max_new_tokens, temperature, top_k, seed):
    """Generate text from a checkpoint (on the CPU).

    \b
    Example:
      codex sample --run runs/web --prompt "def fibonacci(n):" --temperature 0.7 --top-k 40
    """
    cfg = make_config(run, config_file, overrides, {
        "eval.checkpoint": checkpoint, "eval.max_new_tokens": max_new_tokens, "eval.temperature": temperature,
        "eval.top_k": top_k, "eval.seed": seed})
    from eval.sample import run_sample

    click.echo(run_sample(cfg, prompt))


# --- codex demo / hardware ----------------------------------------------------------------------

@cli.command("demo")
@click.option("--run", default="runs/demo", show_default=True, help="Run directory.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a demo config key.")
@stage
def demo_cmd(run, overrides):
    """The whole pipeline on the Python standard library's own sources, on this machine's CPU.

    clean -> tokenize -> shard -> train a small model -> eval, through the same code as the real
    commands; ends with validation perplexity and bits per byte. About 5-10 minutes on 2 cores.

    \b
    Example:
      codex demo
      codex demo --run runs/demo2 --set train.max_steps=50
    """
    from codex import runlock
    from codex.demo import run_demo

    with runlock.hold(run, "codex demo"):
        run_demo(run, overrides)


@cli.command("hardware")
def hardware_cmd():
    """List the hardware presets (devices, memory, bf16 peak used for MFU, default batch).

    \b
    Example:
      codex hardware
    """
    from train.hardware import format_hardware_table

    click.echo(format_hardware_table())


def main():
    cli(prog_name="codex")


if __name__ == "__main__":
    sys.exit(main())
