"""`codex export --format hf`: the exported directory loads in transformers with no custom code and
computes codex's logits (every exportable option combination), generates codex's greedy tokens, and
tokenizes like codex; an option with no standard architecture refuses with exit 2."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from codex.core.config import Config, to_dict
from codex.eval.sample import sample
from codex.model.gpt import build_model
from tests.fixtures.evaluation import make_eval_run, tiny_cfg

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Nothing here may reach the network (the hub, datasets)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def save_model(run: str, model_cfg, step: int, seed: int = 0):
    """A checkpoint of a model with `model_cfg` whose weights are far from the init: std 0.3
    matrices and random norm weights, so a transposed or swapped tensor shows in the logits."""
    from codex.train.checkpoint import folders as checkpoint

    cfg = Config()
    cfg.run = run
    cfg.model = model_cfg
    model = build_model(model_cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    checkpoint.save(
        run,
        {
            "model": model.state_dict(),
            "optimizer": {},
            "step": step,
            "tokens": 99,
            "loader": {"epoch": 0, "position": 0},
            "rng": checkpoint.rng_state(),
            "config": to_dict(cfg),
            "codex_version": "test",
        },
    )
    return model.eval()


def export(run: str, out: Path, step, **kw) -> Path:
    from codex.model.export_hf import export_hf
    from codex.train.checkpoint.read import load_model

    cfg = Config()
    cfg.run = run
    export_hf(*load_model(cfg, step), str(out), **kw)
    return out


COMBOS = [
    dict(qk_norm=q, n_kv_head=kv, tie_embeddings=t)
    for q, kv, t in itertools.product([True, False], [2, 4], [False, True])
]


def test_exported_logits_equal_codex_for_every_exportable_combination(tmp_path):
    from transformers import AutoModelForCausalLM

    run, tok, _ = make_eval_run(tmp_path)
    V = tok.get_vocab_size()
    ids = torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(0))
    diffs = {}
    for i, combo in enumerate(COMBOS):
        m = tiny_cfg(V, n_layer=2, n_head=4, n_embd=32, rope_theta=500.0, norm_eps=1e-5, **combo)
        model = save_model(run, m, step=100 + i, seed=i)
        out = export(run, tmp_path / f"hf{i}", 100 + i, max_shard_size="30KB")
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == [
            "Qwen3ForCausalLM" if combo["qk_norm"] else "LlamaForCausalLM"
        ]
        assert (
            config["vocab_size"] == V and config["tie_word_embeddings"] == combo["tie_embeddings"]
        )
        # sharded: the weights are over 30 KB
        assert (out / "model.safetensors.index.json").exists()
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert hf.config.num_key_value_heads == combo["n_kv_head"]
        with torch.no_grad():
            ours, theirs = model(ids), hf(ids).logits
        assert theirs.shape == ours.shape == (2, 64, V)  # padding rows dropped
        assert ours.abs().max() > 1.0  # logits far from uniform: the check has teeth
        diffs[str(combo)] = float((ours - theirs).abs().max())
    print("max |logit diff| per combination:", json.dumps(diffs, indent=1))
    assert max(diffs.values()) < 1e-4, diffs


def test_generate_matches_codex_greedy_sample_and_tokenizer_matches(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, tok, model = make_eval_run(tmp_path, train_steps=30)
    out = export(run, tmp_path / "hf", 7)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)

    prompt = "The quick brown"
    ours = sample(model.eval(), tok, prompt, max_new_tokens=20, temperature=0)
    enc = hf_tok(prompt, return_tensors="pt")
    assert enc.input_ids[0, 0].item() == 0  # <|bos|> first, as every training document
    # stops at <|eos|> / <|bos|>, as sample does
    gen = hf.generate(**enc, max_new_tokens=20, do_sample=False)
    new = gen[0, enc.input_ids.shape[1] :].tolist()
    assert len(new) >= 5, new  # a real continuation, not an immediate stop
    assert hf_tok.decode(gen[0], skip_special_tokens=True) == ours
    assert len(ours) > len(prompt)

    text = "Grüße aus Köln ✓ déjà vu <|bos|> def add(a, b):\n    return a + b\n"
    plain = tok.encode(text).ids  # a literal <|bos|> is text in codex: never the special id
    assert hf_tok(text, add_special_tokens=False).input_ids == plain
    assert hf_tok(text).input_ids == [0] + plain
    assert hf_tok.decode(plain) == tok.decode(plain, skip_special_tokens=False)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (0, 1, 2)
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == [1, 0] and gen_cfg["pad_token_id"] == 2
    card = (out / "README.md").read_text()
    assert "step 7" in card and "1,234" in card and "Qwen3ForCausalLM" in card


def test_model_card_reports_validation_bits_per_byte(tmp_path):
    from codex.core import fsio

    run, _, _ = make_eval_run(tmp_path)
    fsio.write_json(os.path.join(run, "eval", "step_7.json"), {"step": 7, "bits_per_byte": 1.2345})
    card = (export(run, tmp_path / "hf", 7) / "README.md").read_text()
    assert "1.2345" in card


def test_the_export_has_the_permissions_of_anything_else_the_user_creates(tmp_path, monkeypatch):
    """A shared model directory must be readable by the group: the folder and every file get
    the umask's permissions (tempfile made them 0700 / 0600)."""
    from codex.core import fsio

    run, _, _ = make_eval_run(tmp_path)
    umask = 0o022  # not 0o077, under which the fix and tempfile's 0700 would look alike
    old = os.umask(umask)
    monkeypatch.setattr(fsio, "_UMASK", umask)
    try:
        out = export(run, tmp_path / "hf", 7)
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and {p.stat().st_mode & 0o777 for p in files} == {0o666 & ~umask}


def test_unexportable_option_refuses_with_exit_2(tmp_path):
    from click.testing import CliRunner

    from codex.cli.main import cli

    run, tok, _ = make_eval_run(tmp_path)
    save_model(run, tiny_cfg(tok.get_vocab_size(), mlp="relu2"), step=9)
    out = tmp_path / "hf"
    r = CliRunner().invoke(
        cli, ["export", "--run", run, "--checkpoint", "9", "--format", "hf", "--out", str(out)]
    )
    assert r.exit_code == 2, r.output
    assert "model.mlp=relu2" in r.output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp")]

    r = CliRunner().invoke(cli, ["export", "--run", run, "--checkpoint", "7", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "Qwen3ForCausalLM" in r.output and (out / "config.json").exists()
    r = CliRunner().invoke(cli, ["export", "--run", run, "--checkpoint", "7", "--out", str(out)])
    assert r.exit_code == 2 and "already exists" in r.output
    r = CliRunner().invoke(
        cli, ["export", "--run", run, "--format", "gguf", "--out", str(tmp_path / "x")]
    )
    assert r.exit_code == 2
