"""The config tree: overrides, typed values, unknown keys with suggestions, YAML round trip."""

import pytest
from click.testing import CliRunner

from codex.cli.main import cli
from codex.core.config import (
    CONFIGS_DIR,
    ConfigError,
    all_keys,
    build_config,
    from_dict,
    preset_names,
    to_dict,
    to_yaml,
)
from tests.fixtures.bad_input import invoke


def test_overrides_are_typed_and_nested():
    cfg = build_config(
        overrides=[
            "model.n_layer=6",
            "train.lr=3e-4",
            "data.clean.inputs=[a, b]",
            "train.compile=false",
            "data.shard.val_fraction=0.01",
        ]
    )
    assert cfg.model.n_layer == 6 and isinstance(cfg.model.n_layer, int)
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.data.clean.inputs == ["a", "b"]
    assert cfg.train.compile is False
    assert cfg.data.shard.val_fraction == 0.01


@pytest.mark.parametrize(
    "bad,suggestion",
    [
        ("model.n_layerz=4", "model.n_layer"),
        ("train.lrr=1", "train.lr"),
        ("data.clean.workrs=2", "data.clean.workers"),
    ],
)
def test_unknown_key_names_it_and_suggests(bad, suggestion):
    with pytest.raises(ConfigError) as e:
        build_config(overrides=[bad])
    assert bad.split("=")[0] in str(e.value) and suggestion in str(e.value)


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="model.n_layer: expected an integer"):
        build_config(overrides=["model.n_layer=four"])
    with pytest.raises(ConfigError, match="train.compile: expected true or false"):
        build_config(overrides=["train.compile=maybe"])


@pytest.mark.parametrize(
    "key",
    [
        "model.mlp",
        "train.schedule",
        "train.dtype",
        "train.xla_mode",
        "train.resume",
        "train.wandb",
        "data.shard.format",
        "data.shard.dtype",
        "data.tokenizer.trainer",
        "data.clean.preset",
    ],
)
def test_a_value_outside_a_literal_set_names_the_key_and_the_allowed_values(key):
    with pytest.raises(ConfigError, match=rf"{key}: expected one of .*, got 'nope'"):
        build_config(overrides=[f"{key}=nope"])


def test_the_allowed_values_come_from_the_literal_types():
    # The checks of the stages that dispatch on these values (model/gpt.py,
    # train/optim/optimizer.py) live here.
    with pytest.raises(ValueError, match="model.mlp"):
        build_config(overrides=["model.mlp=gelu"])
    with pytest.raises(ConfigError, match="train.schedule"):
        build_config(overrides=["train.schedule=linear"])
    assert (
        build_config(overrides=["train.wandb=off", "data.shard.format=both"]).train.wandb == "off"
    )


def test_yaml_file_unknown_key_names_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  n_heads: 4\n")
    with pytest.raises(ConfigError) as e:
        build_config(str(f))
    assert (
        str(f) in str(e.value)
        and "model.n_heads" in str(e.value)
        and "model.n_head" in str(e.value)
    )


def test_invalid_yaml_names_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model:\n  n_layer: 4\n bad: [\n")
    with pytest.raises(ConfigError, match="line"):
        build_config(str(f))


def test_precedence_preset_then_file_then_set(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  n_layer: 3\ntrain:\n  lr: 0.5\n")
    cfg = build_config(str(f), ["train.lr=0.25"], model="tiny")
    assert cfg.model.n_layer == 3 and cfg.train.lr == 0.25


def test_the_model_preset_name_is_kept_in_the_config():
    assert build_config(model="124m").model.preset == "124m" and build_config().model.preset == ""
    with pytest.raises(ConfigError, match="no model preset 'huge'"):
        build_config(overrides=["model.preset=huge"])


def test_typed_values_are_applied_as_they_are_after_the_file_and_before_set(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  max_steps: 7\n  lr: 0.5\n")
    cfg = build_config(
        str(f),
        ["train.lr=0.25"],
        values={
            "train.max_steps": 100,
            "train.lr": 0.1,
            "data.clean.inputs": ["a b", "c"],
            "train.xla_cache": None,
        },
    )
    assert (
        cfg.train.max_steps == 100
        and cfg.train.lr == 0.25
        and cfg.data.clean.inputs == ["a b", "c"]
    )
    assert cfg.train.xla_cache == ""
    with pytest.raises(ConfigError, match="train.max_steps: expected an integer"):
        build_config(values={"train.max_steps": "many"})
    with pytest.raises(ConfigError, match="train.xla_mode: expected one of spmd, spawn"):
        build_config(values={"train.xla_mode": "pjrt"})


def test_round_trip_through_yaml_dict():
    import yaml

    cfg = build_config(overrides=["model.n_layer=7", "data.clean.inputs=[x]"])
    again = from_dict(yaml.safe_load(to_yaml(cfg)))
    assert to_dict(again) == to_dict(cfg)
    assert "model.n_layer" in all_keys() and "tiny" in preset_names("model")


def test_cli_bad_key_exits_2_with_one_clear_line():
    res = CliRunner().invoke(cli, ["train", "--set", "model.n_layerz=4"])
    assert res.exit_code == 2
    assert "model.n_layerz" in res.output and "did you mean 'model.n_layer'" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["data", "shard", "--help"],
        ["train", "--help"],
        ["eval", "--help"],
        ["data", "clean", "--help"],
        ["data", "tokenize", "--help"],
        ["demo", "--help"],
    ],
)
def test_help_has_an_example(args):
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "codex" in res.output and ("Example" in res.output or args == ["--help"])


def test_string_keys_keep_their_text():
    # YAML would read `off` as False; on the command line a string key takes the text as given.
    cfg = build_config(overrides=["train.wandb=off", "train.hardware=v6e-4"])
    assert cfg.train.wandb == "off" and cfg.train.hardware == "v6e-4"


def test_yaml_boolean_for_string_key_says_quote_it(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("train:\n  wandb: off\n")
    with pytest.raises(ConfigError, match="train.wandb: expected a string.*quote it"):
        build_config(str(f))


def test_model_depth_derives_the_shape():
    # depth wins over the shape keys
    m = build_config(overrides=["model.depth=12", "model.n_layer=3"]).model
    assert (m.n_layer, m.n_embd, m.n_head, m.n_kv_head) == (12, 768, 6, 6)  # 64 x 12, heads of 128
    assert build_config(overrides=["model.depth=3"]).model.n_embd == 256  # 192 rounded up to 128s
    assert build_config(overrides=["model.depth=2"]).model.n_head == 1  # 128 wide: one head of 128
    with pytest.raises(ConfigError, match="model.depth=-1"):
        build_config(overrides=["model.depth=-1"])


def test_help_shows_each_options_default_from_the_config():
    from click.testing import CliRunner

    from codex.cli.main import cli
    from codex.core.config import Config

    d = Config()
    out = CliRunner().invoke(cli, ["train", "--help"], terminal_width=200).output
    assert f"Optimizer steps to train.  [default: {d.train.max_steps}; x>=0]" in out
    assert f"only at the end.  [default: {d.train.save_every}; x>=0]" in out
    assert f"{d.model.n_layer} layers {d.model.n_embd} wide" in out
    out = CliRunner().invoke(cli, ["data", "tokenize", "--help"], terminal_width=200).output
    assert f"[default: {d.data.tokenizer.vocab_size}; x>=259]" in out
    assert "[default: ]" not in out and "[default: []]" not in out  # no empty defaults shown


@pytest.mark.parametrize(
    "text, key",
    [
        ("data:\n  clean:\n    workers: -1\n", "data.clean.workers"),  # an int out of range
        ("train:\n  lr: -0.5\n", "train.lr"),  # a negative float
        ("model:\n  n_layer: four\n", "model.n_layer"),  # a string for an int
        ("data:\n  shard:\n    format: csv\n", "data.shard.format"),  # not one of the choices
        ("data:\n  clean:\n    chunk_bytes: [1, 2]\n", "data.clean.chunk_bytes"),  # a list
        ("data:\n  clean:\n    text_field: [a, b]\n", "data.clean.text_field"),  # a list, str
        ("data:\n  clean:\n    docs_per_shard: true\n", "data.clean.docs_per_shard"),  # a bool
        ("data:\n  clean:\n    min_yield: yes\n", "data.clean.min_yield"),  # a bool, float
        ("model:\n  n_head: 3\n", "model.n_head"),  # a shape the model cannot take
        ("eval:\n  checkpoint: best\n", "eval.checkpoint"),
        ("train:\n  data:\n    mixture: {web: -1}\n", "train.data.mixture"),
        ("train:\n  data:\n    mixture: [web]\n", "train.data.mixture"),
        ("data:\n  shard:\n    sources: {a/b: runs/x}\n", "data.shard.sources"),
    ],
)
def test_each_bad_value_in_a_config_file_names_the_file_and_the_key(tmp_path, text, key):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    run = tmp_path / "r"
    out = invoke(["data", "clean", "--config", str(f), "--run", str(run), "--input", "x.txt"], 2)
    (error,) = [line for line in out.splitlines() if line.startswith("Error:")]
    assert f"Error: {f}: " in error and key in error, error
    assert not run.exists()


def test_a_value_set_after_the_file_is_refused_without_naming_the_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  lr: -0.5\n")
    assert build_config(str(f), ["train.lr=0.1"]).train.lr == 0.1  # --set wins over the file
    with pytest.raises(ConfigError) as e:
        build_config(str(f), ["train.lr=-2"])
    assert str(e.value).startswith("train.lr=-2.0 is out of range") and str(f) not in str(e.value)


def test_mappings_from_yaml_and_set_and_the_fineweb_recipe_parses():
    want = {"web": 0.7, "code": 0.3}
    for value in ("web:0.7,code:0.3", "web=0.7, code=0.3", "{web: 0.7, code: 0.3}"):
        assert build_config(overrides=[f"train.data.mixture={value}"]).train.data.mixture == want
    cfg = build_config(str(CONFIGS_DIR / "runs" / "fineweb.yaml"))
    assert set(cfg.data.shard.sources) == set(cfg.train.data.mixture) == {"web", "code"}
    c = cfg.data.clean
    assert c.lang.enabled and c.classifier.enabled and c.near_dedup.enabled and c.decontam.enabled
    assert cfg.train.data.mixture_schedule[0]["step"] == 18000
