"""The `codex` command line. Each command builds the typed Config and calls one stage function.

Every command takes `--run DIR` (local or gs://), `--config FILE` and repeated `--set key=value`;
its own flags are shortcuts for config keys (`--workers 4` is `--set data.clean.workers=4`).
User mistakes (unknown key, bad value, missing input) exit 2 with one clear line, no traceback.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import click

from codex.cli.command import (
    ConfigCommand,
    ResolvedHelp,
    UserError,
    config_default,
    config_options,
    key_option,
    name_command,
    preset_hosts,
    run_lock,
    stage,
    with_config,
)
from codex.cli.data_stats import data_stats
from codex.core import fsio, rundir, runlock
from codex.core.config import build_config, yaml_error
from codex.core.config.train import TrainConfig
from codex.core.progress import log_to_file, setup_logging
from codex.train.plan.presets import get_preset
from codex.train.plan.report import format_hardware_table, format_model_fit, format_train_plan
from codex.train.plan.world import require_shared_run_dir, set_xla_import_env

checkpoint_option = key_option("--checkpoint", key="eval.checkpoint")

_DEFAULT_MODEL = config_default("model")


# show_default: every option with a default says it in --help (key_option adds the config's own
# default, its click default staying None); tests/cli/test_cli_help.py checks each one.
@click.group(
    context_settings={
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
        "show_default": True,
    }
)
@click.version_option(package_name="codex")
@click.pass_context
def cli(ctx: click.Context):
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
    name_command(ctx)


@cli.group()
@click.pass_context
def data(ctx: click.Context):
    """Data stages: clean -> tokenize -> shard (and stats, verify, upload)."""
    name_command(ctx)


data.add_command(data_stats)  # its own module: main.py is at the size limit


# --- codex data clean -------------------------------------------------------------------------


def executor_options(fn):
    """--executor and --ray-address: where a data stage's units run (pipeline/executor/)."""
    fn = key_option("--ray-address", key="data.ray_address", metavar="ADDR")(fn)
    return key_option("--executor", key="data.executor")(fn)


def _read_sources(_ctx, _param, path):
    """--sources FILE: a YAML list of {input, preset, txt_delimiter, allow_low_yield}
    (data.clean.sources)."""
    if path is None:
        return None
    import yaml

    try:
        with open(path) as fh:
            sources = yaml.safe_load(fh)
    except OSError as e:
        raise click.BadParameter(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise click.BadParameter(yaml_error(path, e)) from None
    if isinstance(sources, dict) and "sources" in sources:
        sources = sources["sources"]
    if not isinstance(sources, list):
        raise click.BadParameter(f"{path}: want a YAML list of sources ({{input: PATH, ...}})")
    return sources


@data.command("clean", cls=ConfigCommand)
@with_config("data.clean", "data.executor", "data.ray_address", "data.task")
@key_option("--input", key="data.clean.inputs", multiple=True, metavar="PATH")
@executor_options
@key_option("--workers", key="data.clean.workers")
@key_option("--num-tasks", key="data.clean.num_tasks")
@key_option("--task-index", key="data.clean.task_index")
@key_option("--sources", key="data.clean.sources", metavar="FILE", callback=_read_sources)
@key_option("--text-field", key="data.clean.text_field")
@key_option("--text-column", key="data.clean.text_column")
@key_option("--txt-delimiter", key="data.clean.txt_delimiter", metavar="TEXT")
@key_option("--preset", key="data.clean.preset")
@key_option("--keep-rejected/--no-keep-rejected", key="data.clean.keep_rejected")
@key_option("--allow-low-yield/--no-allow-low-yield", key="data.clean.allow_low_yield")
def data_clean(cfg):
    """Clean raw text into parquet shards under RUN/clean/.

    \b
    Example:
      codex data clean --run runs/web --input 'raw/*.jsonl.zst' --workers 2
      codex data clean --run gs://bucket/run --input gs://bucket/raw --num-tasks 8 --task-index 3
      codex data clean --run runs/book --input book.txt --txt-delimiter blank-lines
      codex data clean --run runs/mix --sources sources.yaml   # inputs with their own settings

    \b
    sources.yaml, one input per line, each with the settings it needs (the others: the flags):
      - {input: 'src/**/*.py', preset: code}
      - {input: wikitext-103/, txt_delimiter: blank-lines}
      - {input: linux.txt, preset: code, txt_delimiter: 're:^// SPDX', allow_low_yield: true}
    txt_delimiter 're:REGEX': a line the regex matches starts a document (concatenated files).
    Each source keeping under data.clean.min_source_yield of its bytes exits 1, unless allowed.
    """
    if not cfg.data.clean.inputs and not cfg.data.clean.sources:
        raise UserError(
            "no input: pass --input PATH or --sources FILE (or set data.clean.inputs in --config)"
        )
    with run_lock(cfg, "codex data clean"):
        from codex.pipeline.clean.clean import run_clean

        run_clean(cfg)


# --- codex data tokenize ----------------------------------------------------------------------


@data.command("tokenize", cls=ConfigCommand)
@with_config("data.tokenizer", "data.executor", "data.ray_address", "data.task")
@key_option("--vocab-size", key="data.tokenizer.vocab_size")
@key_option("--max-chars", key="data.tokenizer.max_chars")
@key_option("--doc-max-chars", key="data.tokenizer.doc_max_chars")
@key_option("--trainer", key="data.tokenizer.trainer")
@key_option("--input", key="data.tokenizer.inputs", multiple=True, metavar="PATH")
@key_option("--workers", key="data.tokenizer.workers")
@executor_options
def data_tokenize(cfg):
    """Train a byte-level BPE tokenizer on the cleaned text; writes RUN/tokenizer/.

    Documents are sampled by a hash of their text (smallest hashes until --max-chars), so the
    result does not depend on how many shard files exist or their order. Either trainer writes
    the same kind of HF tokenizer.json.

    \b
    Example:
      codex data tokenize --run runs/web --vocab-size 16384
      codex data tokenize --run runs/web --vocab-size 65536 --max-chars 1000000000
      codex data tokenize --run runs/web --max-chars 4000000000 --trainer hf
    """
    with run_lock(cfg, "codex data tokenize"):
        from codex.pipeline.tokenizer.tokenizer import run_tokenizer

        run_tokenizer(cfg)


# --- codex data shard / verify / upload ---------------------------------------------------------


@data.command("shard", cls=ConfigCommand)
@with_config("data.shard", "data.executor", "data.ray_address", "data.task")
@key_option("--out", key="data.shard.out")
@key_option("--shard-tokens", key="data.shard.shard_tokens")
@key_option("--val-fraction", key="data.shard.val_fraction")
@key_option("--format", key="data.shard.format")
@executor_options
@key_option("--workers", key="data.shard.workers")
def data_shard(cfg):
    """Tokenize the cleaned corpus into fixed-size token shards + manifest.json.

    \b
    Example:
      codex data shard --run runs/web --shard-tokens 50000000 --workers 2
      codex data shard --run runs/web --out gs://bucket/web/shards
    """
    with run_lock(cfg, "codex data shard"):
        from codex.pipeline.shard.shard import run_shard

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
    cfg = build_config(config_file, overrides, run=run_dir or run, values={"data.shard.out": out})
    shards = cfg.data.shard.out or rundir.shards_dir(cfg.run)
    from codex.pipeline.shard.verify import verify_shards

    problems = verify_shards(shards, rundir.tokenizer_dir(cfg.run))
    for p in problems:
        click.echo(p, err=True)
    if problems:
        raise click.ClickException(f"{len(problems)} problem(s) in {shards}")
    click.echo(f"{shards}: every shard matches manifest.json")


@data.command("upload")
@click.argument("local_run", metavar="LOCAL_RUN")
@click.argument("remote", metavar="REMOTE")
@click.option(
    "--overwrite",
    is_flag=True,
    help="When REMOTE holds another run (its stats, tokenizer or manifest differ), delete it first "
    "instead of refusing.",
)
@stage
def data_upload(local_run, remote, overwrite):
    """Copy a local run directory to gs:// (any fsspec URL), verifying each object's size and
    checksum.

    A rerun resumes: objects that already match are skipped, differing ones are re-uploaded.

    \b
    Example:
      codex data upload runs/web gs://bucket/web
    """
    with runlock.hold(remote, "codex data upload"):
        from codex.pipeline.upload import upload_run

        r = upload_run(local_run, remote, overwrite)
    click.echo(
        f"{r['files']} files ({r['uploaded']} uploaded, {r['skipped']} already there), "
        f"all verified ({', '.join(r['checksum'])}) -> {remote}"
    )


# --- codex train --------------------------------------------------------------------------------
# Every command imports its stage inside its body, after the config is checked and the run lock is
# held: a usage mistake or a second writer is refused at once, `codex --help` imports no stage, and
# a machine without one stage's libraries (rustbpe, zstandard, torch) still runs the others.


def _exec_torchrun(n: int) -> None:
    """Replace this process by torchrun starting n copies of this command (without
    --nproc-per-node) on this machine: `python -m codex.cli`, which never imports a train.py from
    the working directory in place of codex's packages."""
    args = list(sys.argv[1:])
    if args[:1] == ["--"]:
        args = args[1:]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    cmd += ["-m", "codex.cli", "--", *out]
    # torchrun would set OMP_NUM_THREADS=1 in each process; the default divides the cores instead
    from codex.train.plan.threads import default_threads

    os.environ.setdefault("OMP_NUM_THREADS", str(default_threads(n).n))
    sys.stderr.flush()
    os.execv(sys.executable, cmd)


def _describe_train(cfg, params) -> list[str]:
    """`codex train --help`'s resolved section, after the options (ResolvedHelp)."""
    return format_train_plan(cfg, params.get("nproc_per_node"))


@cli.command("train", cls=ResolvedHelp, describe=_describe_train)
@with_config("train", "model")
@key_option("--hardware", key="train.hardware")
@click.option(
    "--model",
    default=None,
    help="Model size preset: tiny, 124m, 350m, 1b, 7b (configs/model/). Default: none, the model.* "
    f"defaults, {_DEFAULT_MODEL.n_layer} layers {_DEFAULT_MODEL.n_embd} wide with "
    f"{_DEFAULT_MODEL.n_head} heads (codex/core/config/model.py; --set model.KEY=VALUE).",
)
@key_option("--data", key="train.data_run", metavar="RUN")
@key_option("--max-steps", key="train.max_steps")
@key_option("--batch-tokens", key="train.batch_tokens")
@key_option("--device-batch", key="train.device_batch")
@key_option("--seq-len", key="train.seq_len")
@key_option("--save-every", key="train.save_every")
@key_option("--wandb", key="train.wandb")
@key_option(
    "--resume/--no-resume",
    key="train.resume",
    callback=lambda _ctx, _p, v: None if v is None else ("auto" if v else "never"),
)
@key_option("--xla-mode", key="train.xla_mode")
@key_option("--xla-cache", key="train.xla_cache", metavar="DIR")
@key_option("--max-compiles", key="train.max_compiles")
@key_option("--allow-cpu-xla", key="train.allow_cpu_xla", is_flag=True)
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    default=None,
    help="Start N training processes on this machine through torchrun (one per GPU; gloo "
    "processes on a CPU preset). Across machines, run torchrun yourself (see README). "
    "Default: this one process.",
)
@click.option(
    "--compile-only",
    is_flag=True,
    default=False,
    help="Compile the step for the --hardware TPU slice with libtpu's TPU compiler on this "
    "machine (no TPU needed, nothing trained, no run files needed) and print per-chip HBM "
    "beside the plan, the TPU program's collectives, FLOPs, a modelled step time and MFU, and "
    "the compile time. Exit 1 when the step does not fit. Needs pip install 'codex[tpu-aot]' "
    "beside torch_xla (docs/tpu.md).",
)
def train_cmd(cfg, nproc_per_node, compile_only):
    """Train a model on RUN/shards; checkpoints in RUN/checkpoints, metrics in RUN/metrics.jsonl.

    --help after other options also prints what they resolve to ("Resolved for this command
    line:" the options' values, the model shape, hardware, batch, steps, optimizer, schedule,
    cadence, layout), e.g. `codex train --hardware v6e-4 --model 124m --help`. A value that does
    not resolve (an unknown preset, a setting train would refuse) prints the help, then the error,
    and exits 2.

    \b
    Example:
      codex train --run runs/web --hardware h100-8 --model 124m --batch-tokens 524288
      codex train --run runs/web --hardware h100-8 --model 124m --nproc-per-node 8
      codex train --run runs/web-lr2 --data runs/web --set train.lr=0.002   # runs/web's shards
      PJRT_DEVICE=TPU codex train --run gs://bucket/web --hardware v6e-4 --model 124m
      codex train --hardware v6e-8 --model 7b --compile-only
    """
    if compile_only:
        _compile_only(cfg)
        return
    if nproc_per_node is not None and nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        _exec_torchrun(nproc_per_node)
    # a multi-host slice on a local path: refused before any host writes
    require_shared_run_dir(cfg)
    if get_preset(cfg.train.hardware).kind == "tpu":
        set_xla_import_env()  # before the run lock, whose TPU worker-id lookup imports torch_xla
    with run_lock(cfg, "codex train"):
        from codex.eval.evaluate import (
            evaluate,  # torch (seconds to import): only when a command runs
        )
        from codex.eval.plot import plot_loss
        from codex.train.loop import train

        if cfg.train.xla_mode == "spawn":  # TPU: one process per chip through torch_xla's launcher
            from codex.train.xla.backend import spawn_train

            spawn_train(cfg, functools.partial(train, evaluate=evaluate, plot=plot_loss))
        else:
            train(cfg, evaluate, plot=plot_loss)


def _compile_only(cfg) -> None:
    """`codex train --compile-only` (train/compile_only.py): the report on stdout, exit 1 when
    the step does not fit the slice's chips."""
    import shutil

    from codex.train.compile_only import compile_only

    setup_logging()
    report = compile_only(cfg)
    shutil.rmtree(report.work_dir, ignore_errors=True)
    click.echo("\n".join(report.lines()))
    if not report.fits:
        sys.exit(1)


# --- codex eval / sample ------------------------------------------------------------------------


@cli.command("eval", cls=ConfigCommand)
@with_config("eval")
@checkpoint_option
@key_option("--max-tokens", key="eval.max_tokens")
@key_option("--data", key="eval.data", multiple=True, metavar="PATH")
@key_option("--hardware", key="train.hardware")
@key_option("--device-batch", key="eval.device_batch")
@key_option("--tasks", key="eval.tasks", metavar="T1,T2")
@key_option("--limit", key="eval.tasks_limit")
@key_option("--tasks-path", key="eval.tasks_path", metavar="DIR")
def eval_cmd(cfg):
    """Validation loss, perplexity and bits per byte of a checkpoint; writes RUN/eval/step_N.json
    (and RUN/eval/loss.png from the training metrics). With --tasks: accuracy on lm-eval-harness
    tasks (the checkpoint exported as a Hugging Face model), in RUN/eval/step_N.tasks-<hash>.json.

    \b
    Example:
      codex eval --run runs/web
      codex eval --run runs/web --checkpoint 2000 --data 'heldout/*.txt'
      torchrun --nproc_per_node=8 -m codex.cli eval --run runs/web --hardware h100-8
      codex eval --run runs/web --tasks hellaswag,arc_easy --limit 500
    """
    if cfg.eval.tasks:
        # lm-eval and transformers: optional dependencies
        from codex.eval.tasks import (
            run_tasks as run_eval,
        )
    else:
        from codex.eval.run import run_eval

    # eval writes only RUN/eval, so its lease lives there and it runs beside a trainer; a RUN that
    # does not exist gets no folder made (run_eval says what is missing)
    lock = (
        runlock.hold(rundir.eval_dir(cfg.run), "codex eval", hosts=preset_hosts(cfg))
        if fsio.isdir(cfg.run)
        else contextlib.nullcontext()
    )
    with lock:
        if fsio.isdir(cfg.run):
            log_to_file(cfg.run, "codex eval")  # RUN/logs/eval.log: every line, libraries' too
        run_eval(cfg)


@cli.command("sample", cls=ConfigCommand)
@with_config("eval")
@click.option("--prompt", required=True, help="Text to continue.")
@checkpoint_option
@key_option("--max-new-tokens", key="eval.max_new_tokens")
@key_option("--temperature", key="eval.temperature")
@key_option("--top-k", key="eval.top_k")
@key_option("--seed", key="eval.seed")
@key_option("--hardware", key="train.hardware")
def sample_cmd(cfg, prompt):
    """Generate text from a checkpoint, with a KV cache, on the CPU, a GPU or a TPU.

    \b
    Example:
      codex sample --run runs/web --prompt "def fibonacci(n):" --temperature 0.7 --top-k 40
      codex sample --run runs/web --prompt "Once upon a time" --hardware h100
    """
    from codex.eval.sample import run_sample

    text = run_sample(cfg, prompt)
    if text is not None:  # rank 0 of a multi-process launch prints; the others have nothing to say
        click.echo(text)


# --- codex export -------------------------------------------------------------------------------


@cli.command("export", cls=ConfigCommand)
@with_config()
@checkpoint_option
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["hf", "torch"]),
    default="hf",
    show_default=True,
    help="hf: a Hugging Face model directory (transformers, vLLM, lm-eval-harness); torch: one "
    "file of the weights and the model config that torch.load(weights_only=True) reads.",
)
@click.option(
    "--out",
    required=True,
    metavar="PATH",
    help="hf: a directory to create (local; must not exist); torch: a file to create (local or gs://).",
)
@click.option(
    "--max-shard-size",
    default="2GB",
    show_default=True,
    help="hf: split the safetensors weights above this size.",
)
def export_cmd(cfg, fmt, out, max_shard_size):
    """Export a checkpoint as a model directory that loads with no custom code: safetensors,
    config.json (Qwen3 with QK-norm, Llama without), generation_config.json, tokenizer, README.md;
    or, with --format torch, as one file {"model": state dict, "model_config": dict} for
    model.gpt.GPT.

    \b
    Example:
      codex export --run runs/web --format hf --out exports/web-hf
      vllm serve exports/web-hf
      codex export --run runs/web --checkpoint 2000 --format torch --out exports/web-2000.pt
    """
    if fmt == "torch":
        from codex.model.export_torch import check_export_target, export_torch
        from codex.train.checkpoint.read import read_checkpoint

        check_export_target(out)
        r = export_torch(*read_checkpoint(cfg, cfg.eval.checkpoint), out)
        click.echo(
            f"step {r['step']} ({r['train_tokens']:,} tokens) -> {r['path']} "
            f"({r['bytes'] / 1e6:.1f} MB, vocab {r['vocab_size']})"
        )
        return
    from codex.model.export_hf import (  # imports torch (start-up time)
        check_export_target,
        export_hf,
    )
    from codex.train.checkpoint.read import load_model

    check_export_target(out)
    model, run_cfg, info = load_model(cfg, cfg.eval.checkpoint)
    r = export_hf(model, run_cfg, info, out, max_shard_size=max_shard_size)
    click.echo(
        f"step {r['step']} ({r['train_tokens']:,} tokens) -> {r['path']} ({r['architecture']}, "
        f"vocab {r['vocab_size']})"
    )


@cli.command("demo")
@click.option("--run", default="runs/demo", show_default=True, help="Run directory.")
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a demo config key."
)
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
    with runlock.hold(run, "codex demo"):
        from codex.cli.demo import run_demo

        run_demo(run, overrides)


@cli.command("hardware")
@click.option(
    "--model",
    default=None,
    help="A model preset (tiny, 124m, 350m, 1b, 7b): where it fits and what codex train runs "
    "there (on TPU with its modelled step time and MFU). Default: none, the table of presets.",
)
@click.option(
    "--optimizer",
    type=click.Choice(["adamw", "muon"]),
    default=TrainConfig().optimizer,
    show_default=True,
    help="With --model: the optimizer whose state the plan counts.",
)
@stage
def hardware_cmd(model, optimizer):
    """List the hardware presets (devices, memory, bf16 peak used for MFU, default batch); with
    --model, the plan for that model on every preset, with the modelled step time and MFU on TPU.

    \b
    Example:
      codex hardware
      codex hardware --model 1b
    """
    if model is None:
        click.echo(format_hardware_table())
        return
    from codex.core.config import preset_path

    preset_path("model", model)  # an unknown name: exit 2 with the list and a suggestion
    click.echo(format_model_fit(model, optimizer=optimizer))


def main():
    cli(prog_name="codex")


if __name__ == "__main__":
    sys.exit(main())
