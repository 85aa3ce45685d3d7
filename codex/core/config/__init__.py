"""The whole configuration of a run as one typed dataclass tree, and how it is built.

    Config
      data.clean / data.tokenizer / data.shard   codex/core/config/data.py
      model                                      codex/core/config/model.py
      train                                      codex/core/config/train.py
      eval                                       codex/core/config/eval.py

Built in this order, later wins: dataclass defaults -> `--model NAME` preset
(configs/model/NAME.yaml) -> `--config FILE` (YAML, same nesting) -> a command's own options (typed
values, e.g. `--max-steps 100`) -> each `--set a.b.c=value` (parsed as YAML).
An unknown key anywhere is a ConfigError naming it and suggesting the nearest valid key; a value
of the wrong type names the key and the type it needs. The resolved config is saved (YAML) next to
every artifact a stage writes, so a run directory says how it was made.
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
from codex.core.config.train import TrainConfig


def _configs_dir() -> Path:
    """The YAML presets: codex/configs, in a checkout a link to configs/ at the top, in the wheel
    configs/ itself (pyproject.toml maps it there)."""
    return Path(__file__).resolve().parents[2] / "configs"


CONFIGS_DIR = _configs_dir()


class ConfigError(ValueError):
    """A user mistake in the configuration. The CLI turns it into a usage error (exit 2)."""


@dataclass
class Config:
    run: str = "runs/default"  # the run directory (local path or gs://bucket/run)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def all_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted leaf key, e.g. 'model.n_layer', 'data.clean.workers'."""
    keys = []
    for f in dataclasses.fields(cls):
        t = _field_type(cls, f.name)
        if dataclasses.is_dataclass(t):
            keys += all_keys(t, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def _field_type(cls, name: str):
    return _type_hints(cls)[name]


@functools.cache
def _type_hints(cls) -> dict:
    """typing.get_type_hints(cls), once a class (read only): it evaluates every annotation
    (strings, under `from __future__ import annotations`) each call, and building a config asks
    for hundreds."""
    return typing.get_type_hints(cls)


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
        try:
            return (
                float(str(value).replace("_", ""))
                if not isinstance(value, (int, float))
                else float(value)
            )
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if typ is str:
        if isinstance(value, bool):  # YAML 1.1 reads off/no/yes/on as booleans
            raise ConfigError(
                f"{key}: expected a string, got {value!r} (YAML reads off/on/no/yes as booleans: "
                f'quote it, e.g. {key.rsplit(".", 1)[-1]}: "off")'
            )
        return "" if value is None else str(value)
    return value


def apply_dict(obj, data: dict, prefix: str = "", source: str = "") -> None:
    """Set fields of dataclass `obj` from a nested dict, validating every key."""
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
            apply_dict(getattr(obj, k), v, key + ".", source)
        else:
            setattr(obj, k, _coerce(key, v, typ))


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


def set_key(cfg: Config, assignment: str) -> None:
    """Apply one `section.key=value` override (value parsed as YAML: 4, 3e-4, true, [a, b])."""
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
    if model:
        apply_dict(
            cfg.model,
            load_yaml(str(preset_path("model", model))),
            "model.",
            f"configs/model/{model}.yaml: ",
        )
        cfg.model.preset = model
    if config_file:
        apply_dict(cfg, load_yaml(config_file), "", f"{config_file}: ")
    for key, value in (values or {}).items():
        if value is not None:
            set_value(cfg, key, value)
    for o in overrides:
        set_key(cfg, o)
    if run:
        cfg.run = run
    cfg.model = with_depth(cfg.model)
    check_values(cfg)
    return cfg


# Ranges, checked once when the config is built (exit 2 before any run file is read): (low, high,
# whether the ends themselves are allowed); None = unbounded. A value typed wrong is caught in
# _coerce, a value outside a Literal field's set in _check_choices.
_RANGES = {
    "train.lr": (0, None, True),
    "train.min_lr_ratio": (0, 1, True),
    "train.warmup_steps": (0, None, True),
    "train.decay_fraction": (0, 1, True),
    "train.weight_decay": (0, None, True),
    "train.beta1": (0, 1, True),
    "train.beta2": (0, 1, True),
    "train.muon_lr": (0, None, False),
    "train.muon_momentum": (0, 1, True),
    "train.grad_clip": (0, None, True),
    "train.device_batch": (0, None, True),
    "train.seq_len": (0, None, True),
    "train.batch_tokens": (0, None, True),
    "train.max_steps": (0, None, True),
    "train.max_tokens": (0, None, True),
    "train.log_every": (1, None, True),
    "train.eval_every": (0, None, True),
    "train.eval_tokens": (0, None, True),
    "train.save_every": (0, None, True),
    "train.keep_last": (1, None, True),
    "train.keep_every": (0, None, True),
    "train.max_compiles": (0, None, True),
    "train.shuffle_shards": (0, None, True),
    "train.fsdp_size": (0, None, True),
    "train.threads": (0, None, True),
    "train.gc_every": (0, None, True),
    "train.dist_init_timeout_s": (0, None, False),
    "train.dist_timeout_s": (0, None, False),
    "model.n_layer": (1, None, True),
    "model.depth": (0, None, True),
    "model.n_head": (1, None, True),
    "model.n_kv_head": (1, None, True),
    "model.n_embd": (1, None, True),
    "model.mlp_hidden": (0, None, True),
    "model.max_seq_len": (1, None, True),
    "model.vocab_size": (0, None, True),
    "model.init_std": (0, None, False),
    "model.logit_softcap": (0, None, True),
    "model.norm_eps": (0, None, False),
    "eval.max_tokens": (0, None, True),
    "eval.device_batch": (0, None, True),
    "eval.max_new_tokens": (0, None, True),
    "eval.temperature": (0, None, True),
    "eval.top_k": (0, None, True),
    "data.tokenizer.vocab_size": (259, None, True),
    "data.tokenizer.max_chars": (1, None, True),
    "data.shard.val_fraction": (0, 1, False),
    "data.shard.workers": (0, None, True),
    "data.clean.workers": (0, None, True),
    "data.clean.num_tasks": (1, None, True),
    "data.clean.task_index": (0, None, True),
    "data.clean.docs_per_shard": (1, None, True),
    "data.clean.row_group_size": (1, None, True),
    "data.clean.chunk_bytes": (1, None, True),
    "data.clean.max_record_bytes": (0, None, True),
    "data.clean.length.min_chars": (0, None, True),
    "data.clean.length.max_chars": (0, None, True),
    "data.tokenizer.doc_max_chars": (1, None, True),
    "data.tokenizer.heldout_docs": (0, None, True),
    "data.shard.shard_tokens": (1, None, True),
    "data.shard.chunk_chars": (1, None, True),
    "model.rope_theta": (0, None, False),
}


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
            raise ConfigError(f"{prefix}{f.name}: expected one of {allowed}, got {value!r}")


def check_values(cfg: Config) -> None:
    """Every key with a fixed set of values (a Literal type) or a range, checked at once: a
    ConfigError naming the key and what is allowed, instead of a late failure (or a silent default)
    deep inside a stage."""
    _check_choices(cfg)
    for key, (low, high, inclusive) in _RANGES.items():
        v = get_value(cfg, key)
        nan = v != v  # NaN compares false with every bound
        too_low = nan or (low is not None and (v < low if inclusive else v <= low))
        too_high = high is not None and (v > high if inclusive else v >= high)
        if too_low or too_high:
            want = (
                (f">= {low}" if inclusive else f"> {low}")
                if high is None
                else (f"in [{low}, {high}]" if inclusive else f"in ({low}, {high})")
            )
            raise ConfigError(f"{key}={v!r} is out of range: expected {want}")
    _check_model_shape(cfg.model)
    if cfg.model.preset:
        preset_path("model", cfg.model.preset)  # a ConfigError naming the presets there are
    ckpt = str(cfg.eval.checkpoint)
    if ckpt != "latest" and not (ckpt.isdigit()):
        raise ConfigError(
            f"eval.checkpoint={ckpt!r}: expected a step number (e.g. 2000) or 'latest'"
        )


def _check_model_shape(m) -> None:
    """The shape rules of model/gpt.py's check_config, here so that they exit 2 before a run is
    read."""
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}")
    if (m.n_embd // m.n_head) % 2:
        raise ConfigError(
            f"model.n_embd / model.n_head = {m.n_embd // m.n_head} (the head dim) must be even "
            "for rotary embeddings"
        )
    if m.n_head % m.n_kv_head:
        raise ConfigError(
            f"model.n_head={m.n_head} must be a multiple of model.n_kv_head={m.n_kv_head}"
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
