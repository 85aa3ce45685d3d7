"""The memory plan's shape arithmetic against the model it plans. train/plan/memory.py and
codex/core/config/model.py derive the parameters from ModelConfig by hand (no torch); model/gpt.py
builds them. For every model preset (configs/model/*.yaml) GPT is built on the meta device (shapes
only, no memory) and its parameters are counted: the total, one block's, the matmul weights, and
Muon's matrices (train/optim/muon.py: is_hidden_matrix) with their shapes, in the optimizer's
order, which Muon's step buffers depend on (owner rank = matrix index mod the world)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from codex.core.config import build_config, preset_names
from codex.core.config.model import ModelConfig, matmul_params, mlp_hidden
from codex.model.gpt import GPT
from codex.train.optim.muon import is_hidden_matrix
from codex.train.plan.params import block_params, hidden_matrices, param_count

VOCAB = 4096  # small, and a multiple of 128 like the run's tokenizers; the plan pads as GPT does

# shape options the presets leave at their defaults
VARIANTS = [
    [],
    ["model.tie_embeddings=true", "model.value_embed=true"],
    ["model.mlp=relu2", "model.qk_norm=false", "model.vocab_size=300"],
]


def shapes(m: ModelConfig) -> dict:
    """What the model built from `m` holds, counted off its parameters."""
    with torch.device("meta"):
        model = GPT(m)
    named = dict(model.named_parameters())  # a tied head counts once
    lookups = {"wte.weight"} | {n for n in named if n.startswith("value_embeds.")}
    return {
        "params": sum(p.numel() for p in named.values()),
        # the head counts also when tied to the embedding: those are the FLOPs
        "matmul": sum(
            p.numel() for n, p in model.named_parameters(remove_duplicate=False) if n not in lookups
        ),
        "block": sum(p.numel() for p in model.blocks[0].parameters()),
        "muon": [tuple(p.shape) for n, p in named.items() if is_hidden_matrix(n, p)],
    }


def planned(m: ModelConfig) -> dict:
    """The same, as the plan derives it from the config."""
    return {
        "params": param_count(m),
        "matmul": matmul_params(m),
        "block": block_params(m),
        "muon": hidden_matrices(m),
    }


@pytest.mark.parametrize("overrides", VARIANTS, ids=["preset", "tied+value_embed", "relu2"])
@pytest.mark.parametrize("name", preset_names("model"))
def test_the_plan_counts_the_parameters_and_muon_matrices_gpt_builds(name, overrides):
    m = build_config(model=name, overrides=[f"model.vocab_size={VOCAB}", *overrides]).model
    built = shapes(m)
    assert planned(m) == built, (name, overrides)
    assert len(built["muon"]) == m.n_layer * (7 if m.mlp == "swiglu" else 6)


def test_the_comparison_sees_a_shape_the_plan_would_get_wrong():
    """A plan one MLP tile wider, or with one K/V head fewer, than the model: every count the
    test compares differs, so the check above cannot pass by comparing a source with itself."""
    m = build_config(model="124m", overrides=[f"model.vocab_size={VOCAB}"]).model
    built = shapes(m)
    wider = dataclasses.replace(m, mlp_hidden=mlp_hidden(m) + 128)
    fewer_kv = dataclasses.replace(m, n_kv_head=m.n_kv_head // 2)
    for wrong in (wider, fewer_kv):
        ours = planned(wrong)
        assert all(ours[k] != built[k] for k in built), (wrong, ours)


def test_the_plan_counts_the_data_runs_tokenizer(tmp_path):
    """`--help` and --compile-only count the vocab training will read: the data run's tokenizer
    (train.data_run), else the run's own, else the planned one."""
    from codex.core.config import build_config
    from codex.train.plan.plan import planned_vocab, tokenizer_vocab
    from tests.fixtures.runs import VOCAB, make_run

    data = make_run(tmp_path / "main")
    assert tokenizer_vocab(build_config(overrides=[f"run={data}"])) == VOCAB
    other = [f"run={tmp_path / 'exp2'}"]
    assert tokenizer_vocab(build_config(overrides=other)) is None
    assert planned_vocab(build_config(overrides=other)) != VOCAB
    assert tokenizer_vocab(build_config(overrides=[*other, f"train.data_run={data}"])) == VOCAB
