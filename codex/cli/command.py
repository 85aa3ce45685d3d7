"""How a `codex` command is built: its config options (--run/--config/--set and the key options
that are shortcuts for config keys), its one-line errors and exit codes, and the run lock it
holds while it writes. The commands themselves are in codex/cli/main.py.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil

import click

from codex import fsio, runlock
from codex.config import Config, ConfigError, build_config, get_value


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


def run_lock(cfg, command: str):
    """Hold RUN's lease (codex/runlock.py) while a command writes it; a second writer exits 2.
    The tasks of a `data clean` job array write RUN/clean together: each holds a lease of its
    own."""
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
    from train.plan.hardware import get_preset

    return get_preset(cfg.train.hardware).hosts


def config_options(fn):
    """--run, --config, --set: shared by every command that builds a Config."""
    fn = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override one config key, e.g. --set model.n_layer=6 (repeatable).",
    )(fn)
    fn = click.option(
        "--config",
        "config_file",
        type=str,
        default=None,
        metavar="FILE",
        help="YAML config (see configs/runs/).",
    )(fn)
    fn = click.option(
        "--run",
        type=str,
        default=None,
        metavar="DIR",
        help="Run directory, local path or gs://bucket/run (default: runs/default).",
    )(fn)
    return fn


def key_option(*decls, key: str, **kwargs):
    """An option that is a shortcut for config key `key` (`--workers 4` is data.clean.workers=4).
    Its click parameter is named after the key (dots as '__'); with_config collects it. --help
    shows the key's default from the config (click's own default stays None: "not given")."""
    default, text = config_default(key), kwargs.get("help", "")
    if not isinstance(default, bool) and default not in ("", []) and "default" not in text.lower():
        kwargs["help"] = f"{text}  [default: {default}]"
    return click.option(*decls, key.replace(".", "__"), default=None, **kwargs)


@functools.cache
def _defaults() -> Config:
    return Config()


def config_default(key: str):
    """The default value of dotted config key `key` (the dataclass field's), read from one
    default Config built once for every option."""
    return get_value(_defaults(), key)


def with_config(fn):
    """A command body that takes the built Config: --run/--config/--set (and --model, where the
    command has it) plus the key_options' typed values (None or an empty repeat = not given) go
    to build_config; the body gets `cfg` and its other options. Runs under `stage`."""

    @functools.wraps(fn)
    def wrapper(run, config_file, overrides, model=None, **kwargs):
        values = {
            name.replace("__", "."): kwargs.pop(name) for name in list(kwargs) if "__" in name
        }
        # repeatable
        values = {k: (list(v) or None) if isinstance(v, tuple) else v for k, v in values.items()}
        cfg = build_config(config_file, overrides, model=model, run=run, values=values)
        fsio.require_bucket(cfg.run)
        return fn(cfg, **kwargs)

    return config_options(stage(wrapper))
