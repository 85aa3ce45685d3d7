"""--help says every option's default, and `codex train --help` says what the rest of its command
line resolves to (codex/cli/command.py: ResolvedHelp; train/plan/report.py: format_train_plan)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from codex.cli.command import _shown, config_default
from codex.cli.main import cli
from codex.core.config import Config, build_config, load_yaml, preset_path
from codex.core.config.setting import leaves
from codex.core.config.train import DEFAULT_LR
from codex.train.plan.presets import get_preset
from tests.fixtures.import_graph import ROOT
from tests.fixtures.runs import plan_without_run

RESOLVED = "\nResolved for this command line:\n"  # the section, not the docstring naming it


def _commands(group: click.Group, parent: click.Context):
    """(context, command) for every command under `group`, groups included, each context made as
    Click makes it (so the group's show_default reaches the subcommands)."""
    for name, cmd in sorted(group.commands.items()):
        ctx = click.Context(cmd, info_name=name, parent=parent, **cmd.context_settings)
        yield ctx, cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, ctx)


def _without_default(root: click.Group) -> list[str]:
    """Every option of every command under `root` whose --help line does not say its default.
    Exempt: required options, plain on/off flags (off unless given), repeatable options (empty
    unless given), --help and --version. Every other option either shows `[default: X]` (Click's
    show_default, or key_option's config default) or says in words what happens without it
    ("Default: none, ..."): an option added without one fails here."""
    top = click.Context(root, info_name="codex", **root.context_settings)
    missing = []
    for ctx, cmd in [(top, root), *_commands(root, top)]:
        for p in cmd.get_params(ctx):
            if not isinstance(p, click.Option) or p.hidden or p.required or p.multiple:
                continue
            if (p.is_flag and not p.secondary_opts) or p.name in ("help", "version"):
                continue
            record = p.get_help_record(ctx)
            if record is None or "default" not in record[1].lower():
                missing.append(f"{ctx.command_path} {max(p.opts, key=len)}")
    return missing


def test_every_option_of_every_command_says_its_default():
    assert _without_default(cli) == []


def test_the_default_check_can_fail():
    @click.group(context_settings={"show_default": True})
    def g():
        pass

    @g.command()
    @click.option("--shown", default=3)
    @click.option("--silent", default=None, help="Nothing said.")
    @click.option("--said", default=None, help="Default: none, all of them.")
    @click.option("--flag", is_flag=True)
    def c(shown, silent, said, flag):
        pass

    assert _without_default(g) == ["codex c --silent"]


def test_key_options_show_the_configs_default():
    out = CliRunner().invoke(cli, ["data", "clean", "--help"], terminal_width=200).output
    assert f"[default: {config_default('data.clean.workers')}; x>=0]" in out
    assert "[default: no-keep-rejected]" in out  # a --x/--no-x pair: the one in force, as Click
    assert "[default: ]" not in out and "[default: []]" not in out
    out = CliRunner().invoke(cli, ["export", "--help"], terminal_width=200).output
    assert "[default: hf]" in out and "[default: latest]" in out


def test_every_config_field_reaches_help_with_its_default_help_and_range():
    """Each field of the config tree (codex/core/config/setting.py) is listed in the --help of the
    commands that read it, as `section.key=TYPE`, its record made from the field alone: the help
    text, the default and the range. A field added to a dataclass appears with no edit under
    codex/cli/."""
    top = click.Context(cli, info_name="codex", **cli.context_settings)
    helps = []
    for ctx, cmd in _commands(cli, top):
        ctx.max_content_width = ctx.terminal_width = 100_000
        helps.append(cmd.get_help(ctx))
    text = "\n".join(helps)
    missing = []
    for leaf in leaves(Config):
        if leaf.key == "run":  # --run, on every command
            continue
        default = config_default(leaf.key)
        shown = "none" if default in ("", []) else _shown(default)
        bounds = f"; {leaf.range.as_inequality()}" if leaf.range else ""
        want = f"{leaf.help}  [default: {shown}{bounds}]"
        row = re.search(rf"^  {re.escape(leaf.key)}=\S+(?: +|\n +)(.*)$", text, re.M)
        if not leaf.help or not row or want not in row.group(1):
            missing.append(leaf.key)
    assert missing == []
    # and --help prints them, under a heading that says how to set them
    out = CliRunner().invoke(cli, ["data", "clean", "--help"], terminal_width=200).output
    assert "Config keys (--set KEY=VALUE, or a --config file)" in out
    assert "data.clean.gopher_quality.min_doc_words=INT" in out
    assert "Fewest words a document may have.  [default: 50; x>=0]" in out


def test_a_key_is_set_three_ways_at_most():
    """A short flag where the command has one, --set, --config: no `--section.key` option."""
    top = click.Context(cli, info_name="codex", **cli.context_settings)
    dotted = [
        f"{ctx.command_path} {opt}"
        for ctx, cmd in _commands(cli, top)
        for p in cmd.get_params(ctx)
        for opt in getattr(p, "opts", [])
        if re.fullmatch(r"--\w+\.[\w.]+", opt)
    ]
    assert dotted == []
    bad = CliRunner().invoke(cli, ["train", "--train.lr", "0.002"])
    assert bad.exit_code == 2 and "No such option '--train.lr'" in bad.output


def test_every_number_has_a_range():
    """A numeric setting without a range let 0 or a negative through to loop forever deep in a
    stage (data.clean.dedup.partition_bytes=0): every int and float field states its range."""
    assert [
        leaf.key for leaf in leaves(Config) if leaf.type in (int, float) and not leaf.range
    ] == []


def test_the_cli_defines_no_default_range_or_help_of_a_config_key():
    """The short flags (key_option) take type, default, help and range from the field: a call
    under codex/cli/ that restates one, or a plain click.option that sets a config key (a name
    with '__', as key_option names its parameters), fails here."""
    restated = []
    for f in sorted((ROOT / "codex" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name == "key_option":
                said = {kw.arg for kw in node.keywords} & {"help", "type", "default"}
                restated += [f"{f.name}:{node.lineno} {k}" for k in sorted(said)]
            decls = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if name == "option" and any("__" in str(d) for d in decls):
                restated.append(f"{f.name}:{node.lineno} {decls}")
    assert restated == []


def test_set_reaches_the_resolved_help_and_the_range_check():
    runner = CliRunner()
    args = ["train", "--set", "train.lr=0.002", "--set", "model.n_layer=3", "--help"]
    resolved = runner.invoke(cli, args, terminal_width=200).output.split(RESOLVED, 1)[1]
    assert "train.lr=0.002" in resolved and "model.n_layer=3" in resolved
    bad = runner.invoke(cli, ["data", "clean", "--set", "data.clean.dedup.partition_bytes=0"])
    assert bad.exit_code == 2
    assert "data.clean.dedup.partition_bytes=0 is out of range: expected >= 1" in bad.output


def _help(*args: str):
    return CliRunner().invoke(
        cli, ["train", *args, "--help"], prog_name="codex", terminal_width=200
    )


def _row(out: str, label: str) -> str:
    """The resolved section's `label:` row, its wrapped lines joined."""
    lines = out.split(RESOLVED, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(label + ":"))
    text = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" " * 5):  # a wrapped row goes on under its text
            break
        text.append(line)
    return " ".join(t.strip() for t in text)


def test_train_help_resolves_the_model_hardware_and_overrides():
    res = _help("--hardware", "v6e-4", "--model", "124m", "--set", "train.lr=1e-3")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "Usage: codex train" in out and out.index("Usage:") < out.index(RESOLVED)
    preset = load_yaml(str(preset_path("model", "124m")))
    model = _row(out, "model")
    for key in ("n_layer", "n_embd", "n_head", "n_kv_head", "max_seq_len"):
        assert f"{key}={preset[key]}" in model, (key, model)
    assert "vocab_size=0 (the run's tokenizer's" in model
    hw, cfg = get_preset("v6e-4"), build_config(model="124m", overrides=["train.hardware=v6e-4"])
    hardware = _row(out, "hardware")
    assert f"kind={hw.kind}" in hardware and f"devices={hw.devices}" in hardware
    assert f"hosts={hw.hosts}" in hardware
    # a TPU preset: the fastest modelled step that fits, of 65,536 tokens a chip
    p = plan_without_run(cfg, hw, hw.devices)
    batch = _row(out, "batch")
    assert f"device_batch={p.device_batch} (the fastest modelled step's" in batch, batch
    assert f"seq_len={p.seq_len}" in batch and f"(accum {p.accum};" in batch
    assert f"batch_tokens={65536 * hw.devices:,} a step" in batch
    assert p.time is not None and f"MFU {p.time.mfu:.0%}" in _row(out, "parallel")
    assert "--set" in out and "train.lr=1e-3" in out
    assert "lr=0.001" in _row(out, "optimizer")
    assert f"train.max_steps={Config().train.max_steps}" in out
    assert f"warmup_steps={Config().train.warmup_steps}" in _row(out, "schedule")
    cadence = _row(out, "cadence")
    assert f"eval_every={Config().train.eval_every}" in cadence
    assert f"save_every={Config().train.save_every}" in cadence
    assert "parallel=auto -> " in _row(out, "parallel")


def test_train_help_shows_the_cpu_presets_tokens_a_step_for_tiny():
    out = _help("--hardware", "cpu", "--model", "tiny").output
    batch = " ".join(_row(out, "batch").split())
    assert "batch_tokens=8,192 a step (accum 8; train.batch_tokens=0: cpu's 8,192" in batch, batch
    help_line = " ".join(out.split("--batch-tokens", 1)[1].split("--device-batch", 1)[0].split())
    assert "cpu: 8192 for tiny" in help_line, help_line
    given = " ".join(_row(_help("--model", "tiny", "--device-batch", "8").output, "batch").split())
    assert "batch_tokens=1,024 a step (accum 1; train.batch_tokens=0: one micro-batch)" in given


def test_train_help_alone_resolves_the_defaults():
    res = _help()
    assert res.exit_code == 0, res.output
    d = Config()
    assert f"train.hardware={d.train.hardware}" in res.output
    assert f"n_layer={d.model.n_layer} n_embd={d.model.n_embd}" in _row(res.output, "model")
    assert "kind=cpu" in _row(res.output, "hardware")
    lr = DEFAULT_LR[d.train.optimizer]
    assert f"lr={lr:g} (train.lr=0: the {d.train.optimizer} default)" in _row(
        res.output, "optimizer"
    )


def test_train_help_resolves_config_file_run_and_options(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  n_layer: 3\ntrain:\n  max_steps: 7\n  eval_every: 0\n")
    res = _help("--config", str(f), "--run", str(tmp_path / "r"), "--max-steps", "9")
    assert res.exit_code == 0, res.output
    out = res.output
    assert f"run={tmp_path / 'r'}" in out and str(f) in out
    assert "train.max_steps=9" in out and "max_steps=9," in _row(out, "steps")  # options > file
    assert "n_layer=3 " in _row(out, "model")
    assert "eval_every=0 (off)" in _row(out, "cadence")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--model", "125m"], "no model preset '125m'"),
        (["--hardware", "v9z-4"], "no hardware preset 'v9z-4'"),
        (["--max-steps", "many"], "'many' is not a valid integer"),
        (["--set", "train.lrr=1"], "unknown config key 'train.lrr'"),
        (["--seq-len", "4096"], "longer than model.max_seq_len"),
    ],
)
def test_train_help_with_a_bad_value_prints_the_help_and_one_error_line(args, said):
    res = _help(*args)
    assert res.exit_code == 2
    assert "Usage: codex train" in res.stdout and RESOLVED not in res.stdout
    errors = res.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("Error: ") and said in errors[0], errors
    assert "Traceback" not in res.output


def test_train_help_imports_no_torch():
    """--help stays instant: the resolved section (memory plan included) never imports torch."""
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from codex.cli.main import cli\n"
        "for args in (['train', '--help'], ['train', '--hardware', 'h100-8', '--model', '1b', "
        "'--help']):\n"
        "    res = CliRunner().invoke(cli, args)\n"
        "    assert res.exit_code == 0 and 'Resolved for' in res.output, res.output\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr


def test_the_console_script_loads_no_command_in_a_spawned_worker(tmp_path):
    """pyproject's `codex` script, as pip writes it: spawn starts a data stage's worker process by
    running a script `__main__` again as `__mp_main__` (multiprocessing's _fixup_main_from_path:
    runpy.run_path), so its import line runs in every worker; it must load no command, stage or
    click there. Run as a script, it is the CLI."""
    import tomllib

    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["codex"]
    module, func = target.split(":")
    script = tmp_path / "codex"
    script.write_text(
        f"import sys\nfrom {module} import {func}\n"
        f"if __name__ == '__main__':\n    sys.exit({func}())\n"
    )
    heavy = ("click", "codex.cli.main", "pipeline", "numpy")
    code = (
        "import runpy, sys\n"
        f"runpy.run_path({str(script)!r}, run_name='__mp_main__')\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    res = subprocess.run(
        [sys.executable, str(script), "data", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0 and "Usage: codex data" in res.stdout, res.stdout + res.stderr
