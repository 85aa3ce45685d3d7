"""How a `codex` command is built: its config options (--run/--config/--set and the short flags
that set config keys), its one-line errors and exit codes, and the run lock it
holds while it writes. The commands themselves are in codex/cli/main.py.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import typing
from collections.abc import Callable

import click

from codex.core import fsio, progress, runlock, store
from codex.core.config import Config, ConfigError, build_config, get_value
from codex.core.config.setting import Leaf, leaves


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
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise click.ClickException(_disk_full(e)) from None
            raise click.ClickException(
                f"{_one_line(e)}  (CODEX_DEBUG=1 shows the traceback)"
            ) from None
        except (ValueError, RuntimeError) as e:
            raise click.ClickException(
                f"{_one_line(e)}  (CODEX_DEBUG=1 shows the traceback)"
            ) from None

    return wrapper


def _disk_full(e: OSError) -> str:
    """A full disk, in one line: the file being written, the space left there, what to do. The
    write was atomic (temp + rename) or behind a marker, so nothing written before is lost and a
    rerun resumes."""
    path = e.filename or "a file"
    where = os.path.dirname(os.path.abspath(path)) if e.filename else "."
    while where and not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        free = f"{shutil.disk_usage(where).free / 1e6:.1f} MB free on its disk"
    except OSError:
        free = "its disk is full"
    return (
        f"{path}: no space left on the device ({free}); free some space or write the run "
        "elsewhere (--run), then rerun: finished work is kept"
    )


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def name_command(ctx: click.Context) -> None:
    """A group's callback: the command about to run names the logger of the code every command
    shares (codex/core/progress.py: command_log): `codex sample` logs as codex.sample, `codex
    data clean` as codex.clean. Put back when the command ends (a program may run several)."""
    group, name = ctx.command, ctx.invoked_subcommand
    if not isinstance(group, click.Group) or name is None:
        return
    if isinstance(group.get_command(ctx, name), click.Group):
        return  # `codex data`: its own callback names the command under it
    before = progress.set_command(name)
    ctx.call_on_close(lambda: progress.set_command(before))


def run_lock(cfg, command: str):
    """Hold RUN's lease (codex/core/runlock.py) while a command writes it; a second writer exits 2.
    The tasks of a `data clean` job array write RUN/clean together: each holds a lease of its
    own."""
    progress.log_to_file(cfg.run, command)  # RUN/logs/<command>.log: every line, libraries' too
    c = cfg.data.clean
    if command == "codex data clean" and c.num_tasks > 1:
        return runlock.hold(
            cfg.run,
            f"{command} (task {c.task_index})",
            lease_name=f".codex-lock.clean-task-{c.task_index:05d}.json",
        )
    return runlock.hold(
        cfg.run, command, hosts=preset_hosts(cfg) if command == "codex train" else 1
    )


def preset_hosts(cfg) -> int:
    """How many hosts cfg.train.hardware spans (the run lock asks a multi-host TPU slice which
    worker this is)."""
    from codex.train.plan.presets import get_preset

    return get_preset(cfg.train.hardware).hosts


def config_options(fn):
    """--run, --config, --set: shared by every command that builds a Config."""
    fn = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override one config key, e.g. --set model.n_layer=6 (repeatable; applied last).",
    )(fn)
    fn = click.option(
        "--config",
        "config_file",
        type=str,
        default=None,
        metavar="FILE",
        help="YAML config (see configs/runs/); its keys come after --model's and before the "
        "options'.  [default: none]",
    )(fn)
    fn = click.option(
        "--run",
        type=str,
        default=None,
        metavar="DIR",
        help="Run directory, local path or gs://bucket/run (default: runs/default).",
    )(fn)
    return fn


# --- options generated from the config's fields ------------------------------------------------
# A config field (codex/core/config/setting.py) carries its type, default, help and range. Every
# short flag that sets a config key takes all four from it (key_option), and --help lists every key
# a command reads with the same four (ConfigCommand). A key is set three ways: its short flag where
# the command has one, --set KEY=VALUE, a --config file. Nothing here repeats a default or a range.


@functools.cache
def _leaves() -> dict[str, Leaf]:
    return {leaf.key: leaf for leaf in leaves(Config)}


def _leaf(key: str) -> Leaf:
    return _leaves()[key]


def key_help(key: str, *, flag: str = "") -> str:
    """The field's help with its default and range, for an option that sets `key`. A --x/--no-x
    `flag` pair shows the one in force, as Click does."""
    leaf = _leaf(key)
    default = config_default(key)
    if isinstance(default, bool) and "/" in flag:
        on, off = flag.split("/", 1)
        shown = (on if default else off).lstrip("-")
    else:
        shown = _shown(default) if default not in ("", []) else "none"
    extra = f"; {leaf.range.as_inequality()}" if leaf.range else ""
    return f"{leaf.help}  [default: {shown}{extra}]"


def _metavar(leaf: Leaf) -> str:
    typ = leaf.type
    if typing.get_origin(typ) is typing.Literal:
        return "[" + "|".join(str(v) for v in typing.get_args(typ)) + "]"
    if typing.get_origin(typ) is list:
        return "YAML" if typing.get_args(typ) == (dict,) else "A,B,..."
    if typing.get_origin(typ) is dict:
        return "NAME:VALUE,..."
    names = {int: "INT", float: "FLOAT", bool: "BOOL"}
    return names.get(typ, "TEXT")


def key_option(*decls, key: str, **kwargs):
    """A short flag for config key `key` (`--workers 4` is data.clean.workers=4), its help, default
    and range from the key's field; `kwargs` only shape the flag (multiple, is_flag, callback,
    metavar). Its click parameter is named after the key (dots as '__'); with_config collects it.
    Click's own default stays None: "not given"."""
    leaf = _leaf(key)
    repeat = " (repeatable)" if kwargs.get("multiple") else ""
    kwargs.setdefault("help", key_help(key, flag=decls[0]).replace("  [", f"{repeat}  [", 1))
    if "/" not in decls[0] and not kwargs.get("is_flag") and "callback" not in kwargs:
        if typing.get_origin(leaf.type) is typing.Literal:
            kwargs.setdefault("type", click.Choice([str(v) for v in typing.get_args(leaf.type)]))
        elif leaf.type in (int, float):
            kwargs.setdefault("type", leaf.type)
    return click.option(*decls, key.replace(".", "__"), default=None, **kwargs)


class ConfigCommand(click.Command):
    """A command that builds a Config: its --help lists the command's own options, then every
    config key it reads (with_config's sections), each with the field's help, default and range,
    to set with --set KEY=VALUE or a --config file."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_options(ctx, formatter)
        sections = getattr(self.callback, "config_sections", ())
        rows = [
            (f"{leaf.key}={_metavar(leaf)}", key_help(leaf.key))
            for key, leaf in _leaves().items()
            if any(key == p or key.startswith(p + ".") for p in sections)
        ]
        if rows:
            with formatter.section("Config keys (--set KEY=VALUE, or a --config file)"):
                formatter.write_dl(rows)


@functools.cache
def _defaults() -> Config:
    return Config()


def config_default(key: str):
    """The default value of dotted config key `key` (the dataclass field's), read from one
    default Config built once for every option."""
    return get_value(_defaults(), key)


def with_config(*sections: str):
    """A command body that takes the built Config, reading the config keys under `sections`
    (listed in its --help): --run/--config/--set (and --model, where the command has it) and the
    key options' typed values go to build_config; the body gets `cfg` and its other options.
    Runs under `stage`. The command's class must be ConfigCommand (or a subclass)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(**params):
            cfg, rest = config_from_params(params)
            store.configure(cfg.store_timeout_s, cfg.data.task.io_retries)
            fsio.require_bucket(cfg.run)
            return fn(cfg, **rest)

        # store_timeout_s: every command may touch an object store
        wrapper.config_sections = (*sections, "store_timeout_s")  # type: ignore[attr-defined]
        return config_options(stage(wrapper))

    return decorate


def config_from_params(params: dict) -> tuple[Config, dict]:
    """(the Config, the command's other parameters) from a with_config command's parsed click
    parameters: --run/--config/--set, --model where the command has it and the key options (None
    or an empty repeat = not given). The one path
    from a command line to its Config: the command body and its --help's resolved section
    (ResolvedHelp) both take it."""
    rest = dict(params)
    run, config_file, overrides = rest.pop("run"), rest.pop("config_file"), rest.pop("overrides")
    model = rest.pop("model", None)
    values = {name.replace("__", "."): rest.pop(name) for name in list(rest) if "__" in name}
    # repeatable
    values = {k: (list(v) or None) if isinstance(v, tuple) else v for k, v in values.items()}
    overrides = list(overrides or ())
    cfg = build_config(config_file, overrides, model=model, run=run, values=values)
    return cfg, rest


def _shown(value) -> str:
    """A config value as --set would take it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "[]"
    return '""' if value == "" else str(value)


class ResolvedHelp(ConfigCommand):
    """A with_config command whose --help also says what the rest of its command line resolves to:
    `codex train --model 124m --set train.lr=1e-3 --help` prints the help, then "Resolved for this
    command line:" with every key option's effective value (defaults -> --model -> --config -> the
    options -> --set, through config_from_params, as the command itself would build it) and what
    `describe(cfg, other_params)` derives from them (lines; it may raise ConfigError). A command
    line that does not resolve (an unknown preset, a bad value) prints the help, then one
    "Error: ..." line, and exits 2. Click handles --help before the other options (it is eager),
    hence parse_args here. Nothing heavy may be imported on this path: --help stays instant."""

    def __init__(
        self, *args, describe: Callable[[Config, dict], list[str]] | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.describe = describe

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        asks = [i for i, a in enumerate(args[:end]) if a in ctx.help_option_names]
        if ctx.resilient_parsing or not asks:
            return super().parse_args(ctx, args)
        rest = [a for i, a in enumerate(args) if i not in asks]
        click.echo(ctx.get_help(), color=ctx.color)
        try:
            lines = self.resolved(ctx, rest)
        except click.UsageError as e:
            problem = e.format_message()
        except (ConfigError, OSError, ValueError) as e:
            problem = _one_line(e)
        else:
            click.echo("\n".join(["", "Resolved for this command line:", *lines]), color=ctx.color)
            ctx.exit(0)
        click.echo(f"Error: this command line does not resolve: {problem}", err=True)
        ctx.exit(2)

    def resolved(self, ctx: click.Context, args: list[str]) -> list[str]:
        """The section's lines: the options' effective values, then describe's."""
        with self.make_context(ctx.info_name, args, parent=ctx.parent) as sub:
            params = dict(sub.params)
        cfg, rest = config_from_params(params)
        rows = [("--run", f"run={cfg.run}"), ("--config", params["config_file"] or "(none)")]
        rows += [("--set", o) for o in params["overrides"] or ()]
        for p in self.params:
            if not isinstance(p, click.Option) or p.name in ("run", "config_file", "overrides"):
                continue
            flag = max(p.opts, key=len)
            if p.name and "__" in p.name:
                key = p.name.replace("__", ".")
                rows.append((flag, f"{key}={_shown(get_value(cfg, key))}"))
            elif p.name == "model":
                rows.append(
                    (flag, f"model.preset={cfg.model.preset or '(none: model.* defaults)'}")
                )
            elif p.name:
                v = params.get(p.name)
                rows.append((flag, "(not given)" if v is None else _shown(v)))
        width = max(len(flag) for flag, _ in rows) + 2
        lines = [f"  {flag:<{width}}{text}" for flag, text in rows]
        return lines + (self.describe(cfg, rest) if self.describe else [])
