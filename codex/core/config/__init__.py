"""The whole configuration of a run as one typed dataclass tree, and how it is built.

    Config
      data.clean / data.tokenizer / data.shard   codex/core/config/data.py
      model                                      codex/core/config/model.py
      train                                      codex/core/config/train.py
      eval                                       codex/core/config/eval.py

Built in this order, later wins: defaults -> `--model NAME` -> `--config FILE` -> a command's own
options -> each `--set a.b.c=value`. An unknown key or a wrongly typed value is a ConfigError
naming the key, and the file when a file set it. docs/cli.md, "Config files and `--set`", has
the details.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from codex.core import fsio
from codex.core.config.data import DataConfig
from codex.core.config.eval import EvalConfig
from codex.core.config.model import ModelConfig, with_depth
from codex.core.config.setting import ConfigError, check_ranges, leaves, setting, type_hints
from codex.core.config.train import SOURCE_NAME, TrainConfig, check_mixture
from codex.core.store import StoreSettings


def _configs_dir() -> Path:
    """The YAML presets: codex/configs, in a checkout a link to configs/ at the top, in the wheel
    configs/ itself (pyproject.toml maps it there)."""
    return Path(__file__).resolve().parents[2] / "configs"


CONFIGS_DIR = _configs_dir()


@dataclass
class Config:
    run: str = setting("runs/default", "The run directory, a local path or gs://bucket/run.")
    store_timeout_s: float = setting(
        StoreSettings.timeout_s,
        "How long an object store (gs://) may fail or hang every request before the command "
        "stops with one line naming it; each request is retried until then (any command: "
        "clean, shard, train's checkpoints).",
        gt=0,
        le=86_400,
    )
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


@functools.cache
def all_keys() -> list[str]:
    """Every dotted leaf key, e.g. 'model.n_layer', 'data.clean.workers'."""
    return [leaf.key for leaf in leaves(Config)]


def _field_type(cls, name: str):
    return type_hints(cls)[name]


def _suggest(bad: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(bad, valid, n=1, cutoff=0.5)
    if not close:  # compare the last component too: "model.n_layerz" -> "n_layer"
        leaf = {k.rsplit(".", 1)[-1]: k for k in valid}
        close = [
            leaf[m]
            for m in difflib.get_close_matches(bad.rsplit(".", 1)[-1], list(leaf), n=1, cutoff=0.6)
        ]
    return f"; did you mean '{close[0]}'?" if close else ""


def _value_type(typ):
    """The type a field's value is coerced to: a Literal's values share one type (str)."""
    if typing.get_origin(typ) is typing.Literal:
        return type(typing.get_args(typ)[0])
    return typ


def _coerce(key: str, value, typ):
    """Convert a YAML/--set value to the field's type, or raise ConfigError naming the key.
    A Literal field gets its values' type here; check_values checks the value itself."""
    typ = _value_type(typ)
    origin = typing.get_origin(typ)
    if origin is dict:  # typed; a bare dict (a sources.yaml entry) is checked where it is used
        return _coerce_mapping(key, value, typing.get_args(typ))
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(typ) or (str,)
        return [_coerce(key, v, item) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            f = float(str(value).replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if f != int(f):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(f)
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return (
                float(str(value).replace("_", ""))
                if not isinstance(value, (int, float))
                else float(value)
            )
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if typ is str:
        if isinstance(value, (list, dict)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        if isinstance(value, bool):  # YAML 1.1 reads off/no/yes/on as booleans
            raise ConfigError(
                f"{key}: expected a string, got {value!r} (YAML reads off/on/no/yes as booleans: "
                f'quote it, e.g. {key.rsplit(".", 1)[-1]}: "off")'
            )
        return "" if value is None else str(value)
    return value


def _coerce_mapping(key: str, value, args: tuple) -> dict:
    """A mapping setting from YAML ({a: 0.7, b: 0.3}) or a --set string (a:0.7,b:0.3 or
    a=0.7,b=0.3); each value coerced to the mapping's value type, named `key.name`."""
    if isinstance(value, str):
        text = value.strip()
        parsed = _yaml_or_none(text) if text.startswith("{") else None
        if parsed is None and text:
            parsed = {}
            for item in (i for i in text.split(",") if i.strip()):
                sep = "=" if "=" in item else ":"
                name, found, v = item.partition(sep)
                if not found or not name.strip():
                    raise ConfigError(f"{key}: expected NAME:VALUE,..., got {value!r}")
                parsed[name.strip()] = v.strip()
        value = parsed or {}
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping (e.g. {{a: 1, b: 2}}), got {value!r}")
    kt, vt = args
    return {_coerce(key, k, kt): _coerce(f"{key}.{k}", v, vt) for k, v in value.items()}


def _yaml_or_none(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def apply_dict(
    obj, data: dict, prefix: str = "", source: str = "", origins: dict | None = None
) -> None:
    """Set fields of dataclass `obj` from a nested dict, validating every key. `source` ("FILE: ")
    starts each refusal; `origins` gets it for each key set (build_config's check_values)."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}"
        )
    names = {f.name for f in dataclasses.fields(obj)}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in names:
            raise ConfigError(f"{source}unknown config key '{key}'{_suggest(key, all_keys())}")
        typ = _field_type(type(obj), k)
        if dataclasses.is_dataclass(typ):
            apply_dict(getattr(obj, k), v, key + ".", source, origins)
            continue
        try:
            setattr(obj, k, _coerce(key, v, typ))
        except ConfigError as e:
            raise ConfigError(f"{source}{e}", (key,)) from None
        if origins is not None:
            origins[key] = source


def _leaf_type(key: str):
    """The type of dotted leaf key `key`, or a ConfigError naming it and the nearest valid key."""
    if key not in all_keys():
        raise ConfigError(f"unknown config key '{key}'{_suggest(key, all_keys())}")
    owner = Config
    for p in key.split(".")[:-1]:
        owner = _field_type(owner, p)
    return _field_type(owner, key.rsplit(".", 1)[-1])


def set_value(cfg: Config, key: str, value) -> None:
    """Set one dotted key to a typed value (a CLI option's), coerced and type-checked like --set."""
    typ = _leaf_type(key)
    owner = cfg
    for p in key.split(".")[:-1]:
        owner = getattr(owner, p)
    setattr(owner, key.rsplit(".", 1)[-1], _coerce(key, value, typ))


def set_key(cfg: Config, assignment: str) -> str:
    """Apply one `section.key=value` override (value parsed as YAML: 4, 3e-4, true, [a, b]);
    returns the key."""
    if "=" not in assignment:
        raise ConfigError(
            f"--set {assignment!r}: expected section.key=value, e.g. --set model.n_layer=4"
        )
    key, raw = assignment.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if _value_type(_leaf_type(key)) is str:  # --set train.wandb=off means the string "off"
        # A value of only whitespace is meant as typed: --set data.clean.txt_delimiter=$'\n\n'.
        value = raw.strip().strip("'\"") if raw.strip() else raw
    set_value(cfg, key, raw if isinstance(value, dict) else value)
    return key


def preset_path(kind: str, name: str) -> Path:
    path = CONFIGS_DIR / kind / f"{name}.yaml"
    if not path.exists():
        names = preset_names(kind)
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"no {kind} preset '{name}' (have: {', '.join(names)}){hint}")
    return path


def preset_names(kind: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS_DIR / kind).glob("*.yaml"))


def load_yaml(path: str) -> dict:
    try:
        text = fsio.read_text(str(path))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error(path, e)) from None
    return data


def yaml_error(path: str, e: Exception) -> str:
    """One line for a YAML parse error: 'FILE line N: invalid YAML (problem)'."""
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}" if mark else ""
    return f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})"


def build_config(
    config_file: str | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    model: str | None = None,
    run: str | None = None,
    values: dict | None = None,
) -> Config:
    """The Config of a command: defaults -> the `model` preset -> `config_file` -> `values` (typed,
    from CLI options; None = not given) -> `overrides` (--set strings) -> `run`; then
    check_values."""
    cfg = Config()
    origins: dict[str, str] = {}  # key -> "FILE: " for each value a file set
    if model:
        apply_dict(
            cfg.model,
            load_yaml(str(preset_path("model", model))),
            "model.",
            f"configs/model/{model}.yaml: ",
            origins,
        )
        cfg.model.preset = model
    if config_file:
        apply_dict(cfg, load_yaml(config_file), "", f"{config_file}: ", origins)
    for key, value in (values or {}).items():
        if value is not None:
            set_value(cfg, key, value)
            origins.pop(key, None)
    for o in overrides:
        origins.pop(set_key(cfg, o), None)
    if run:
        cfg.run = run
        origins.pop("run", None)
    cfg.model = with_depth(cfg.model)
    try:
        check_values(cfg)
    except ConfigError as e:  # name the file that set the refused value, if one did
        source = next((origins[k] for k in e.keys if k in origins), "")
        if not source:
            raise
        raise ConfigError(f"{source}{e}", e.keys) from None
    return cfg


def get_value(cfg, key: str):
    """The value of dotted key `key` ('train.max_steps') in a Config."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_choices(obj, prefix: str = "") -> None:
    """Every Literal-typed field of the dataclass tree holds one of its Literal's values."""
    for f in dataclasses.fields(obj):
        typ = _field_type(type(obj), f.name)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(typ):
            _check_choices(value, prefix + f.name + ".")
        elif typing.get_origin(typ) is typing.Literal and value not in typing.get_args(typ):
            allowed = ", ".join(str(a) for a in typing.get_args(typ))
            raise ConfigError(
                f"{prefix}{f.name}: expected one of {allowed}, got {value!r}", (prefix + f.name,)
            )


def check_values(cfg: Config) -> None:
    """Every key with a fixed set of values (a Literal type) or a range, checked at once: a
    ConfigError naming the key and what is allowed, instead of a late failure (or a silent default)
    deep inside a stage."""
    _check_choices(cfg)
    check_ranges(cfg)
    _check_model_shape(cfg.model)
    check_mixture(cfg.train.data)
    _check_shard_sources(cfg.data.shard.sources)
    if cfg.model.preset:
        preset_path("model", cfg.model.preset)  # a ConfigError naming the presets there are
    ckpt = str(cfg.eval.checkpoint)
    if ckpt != "latest" and not (ckpt.isdigit()):
        raise ConfigError(
            f"eval.checkpoint={ckpt!r}: expected a step number (e.g. 2000) or 'latest'",
            ("eval.checkpoint",),
        )


def _check_shard_sources(sources: dict) -> None:
    """data.shard.sources: each a folder-safe name and a run."""
    for name, run in sources.items():
        if not SOURCE_NAME.fullmatch(name):
            raise ConfigError(
                f"data.shard.sources: {name!r} is not a source name (letters, digits, _ . -)",
                ("data.shard.sources",),
            )
        if not run:
            raise ConfigError(
                f"data.shard.sources.{name}: expected the run holding its clean/",
                ("data.shard.sources",),
            )


def _check_model_shape(m) -> None:
    """The shape rules of model/gpt.py's check_config, here so that they exit 2 before a run is
    read."""
    shape = ("model.n_embd", "model.n_head", "model.n_kv_head")
    if m.n_embd % m.n_head:
        raise ConfigError(
            f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}", shape
        )
    if (m.n_embd // m.n_head) % 2:
        raise ConfigError(
            f"model.n_embd / model.n_head = {m.n_embd // m.n_head} (the head dim) must be even "
            "for rotary embeddings",
            shape,
        )
    if m.n_head % m.n_kv_head:
        raise ConfigError(
            f"model.n_head={m.n_head} must be a multiple of model.n_kv_head={m.n_kv_head}", shape
        )


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    cfg = Config()
    apply_dict(cfg, data)
    return cfg


def to_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config (YAML) next to an artifact, atomically."""
    fsio.write_text(path, to_yaml(cfg))
