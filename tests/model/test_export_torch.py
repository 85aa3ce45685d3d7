"""`codex export --format torch`: one file that torch.load(weights_only=True) reads, whose weights
in model.gpt.GPT give the same logits as the model eval loads from the checkpoint."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from codex.cli.main import cli
from codex.core.config import Config, build_config
from codex.core.config.model import ModelConfig
from codex.eval.evaluate import evaluate
from codex.model.gpt import GPT
from codex.train.checkpoint.read import load_model
from codex.train.loop import train
from tests.fixtures.runs import VOCAB, base_overrides, make_run


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_exported_file_loads_with_weights_only_and_gives_the_checkpoints_logits(tmp_path, tied):
    run = make_run(tmp_path / "run")
    overrides = base_overrides(max_steps=3, save_every=2) + [
        f"model.tie_embeddings={str(tied).lower()}"
    ]
    train(build_config(overrides=overrides, run=str(run)), evaluate)  # checkpoints at steps 2 and 3
    out = tmp_path / "exports" / "model.pt"
    res = CliRunner().invoke(
        cli,
        ["export", "--run", str(run), "--checkpoint", "2", "--format", "torch", "--out", str(out)],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert "step 2 " in res.output and str(out) in res.output

    saved = torch.load(out, weights_only=True)
    assert (
        set(saved) == {"model", "model_config", "step", "tokenizer_sha256"} and saved["step"] == 2
    )
    assert all(type(v) in (str, int, float, bool) for v in saved["model_config"].values())
    model = GPT(ModelConfig(**saved["model_config"]))
    model.load_state_dict(saved["model"])
    model.eval()
    assert (model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()) == tied
    assert (
        saved["model"]["lm_head.weight"].data_ptr() == saved["model"]["wte.weight"].data_ptr()
    ) == tied

    cfg = Config()
    cfg.run = str(run)
    reference, run_cfg, _ = load_model(cfg, 2)
    assert run_cfg.model.vocab_size == VOCAB == saved["model_config"]["vocab_size"]
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        # the step asked for, not the latest
        assert not torch.equal(model(x), load_model(cfg, 3)[0](x))

    again = CliRunner().invoke(
        cli, ["export", "--run", str(run), "--format", "torch", "--out", str(out)]
    )
    assert again.exit_code == 2 and "already exists" in again.output
