"""train.parallel=fsdp on the XLA SPMD backend (train/xla/sharding.py), for real on the XLA CPU
backend with 4 devices (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4).

Run in the XLA venv:  PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla
tests/train/xla/test_xla_fsdp.py

The runs are tests/train/xla/test_xla.py's (tiny model, seq 32, 512 tokens a step with accumulation
2, fp32,
lr 1e-3, the default optimizer: Muon for the blocks' matrices + AdamW for the rest), shared by every
test of this file through one fixture and four subprocesses (two at a time):

    eager        (no XLA)   10 steps, checkpoint at 5: the reference; 5 steps with AdamW only
    fsdp4        (4 dev.)   fsdp=4, 10 steps, checkpoints at 5 and 10, validation at 10; the live
                            sharded model's logits on fixed tokens; resume eager's step-5 checkpoint
    fsdp2        (4 dev.)   fsdp=2 x replica=2, AdamW only, 5 steps
    eager_resume (no XLA)   resume fsdp4's step-5 checkpoint on the eager CPU path to step 10

Each XLA run hands its model and optimizer out of the real loop (train.loop.make_optimizer wrapped),
and the script reads every parameter's and optimizer state tensor's sharding and per-device shapes
after the run.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from codex.train.xla.sharding import model_specs, param_spec
from tests.fixtures.runs import make_run
from tests.fixtures.xla import max_diff, model_at, overrides, run_eager, run_xla_script

pytestmark = pytest.mark.xla

DEVICES = 4

# Hands the loop's model and optimizer to the script, and counts the optimizer state tensors the
# step hooks mark (train/xla/sharding.py: shard_optimizer_state).
CAPTURE = """
import codex.train.loop as loop_module
from codex.train.xla import sharding as xla_sharding
import torch_xla.core.xla_model as xm
captured, marks = {}, []
_make_optimizer, _shard_state = loop_module.make_optimizer, xla_sharding.shard_optimizer_state

def _capture(raw, *args, **kwargs):
    captured["model"], captured["optimizer"] = raw, _make_optimizer(raw, *args, **kwargs)
    marks.clear()
    return captured["optimizer"]

def _counted(optimizer):
    marks.append(_shard_state(optimizer))
    return marks[-1]

loop_module.make_optimizer, xla_sharding.shard_optimizer_state = _capture, _counted

def layout():
    xm.wait_device_ops()
    opt = captured["optimizer"]
    parts = list(opt.optimizers.values()) if hasattr(opt, "optimizers") else [opt]
    out = {}
    for name, p in captured["model"].named_parameters():
        state = next((o.state[p] for o in parts if p in o.state), {})
        out[name] = {"shape": list(p.shape), "sharding": xla_sharding.sharding_of(p),
                     "local": xla_sharding.local_shard_shapes(p),
                     "state": {k: {"sharding": xla_sharding.sharding_of(v),
                                   "local": xla_sharding.local_shard_shapes(v)}
                               for k, v in state.items()
                               if isinstance(v, torch.Tensor) and v.shape == p.shape}}
    return {"params": out, "marks": list(marks)}
"""


def copy_checkpoint(src: str, dst: str, step: int) -> None:
    name = f"step_{step:08d}"
    shutil.copytree(Path(src) / "checkpoints" / name, Path(dst) / "checkpoints" / name)


def fsdp(steps: int, size: int, **extra) -> list[str]:
    return overrides("v6e-4", 2, steps, parallel="fsdp", fsdp_size=size, **extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("xla_fsdp")
    make_run(root / "data")
    d = {
        name: str(root / name)
        for name in ("eager", "eager_adamw", "fsdp4", "fsdp2", "resume_xla", "resume_eager")
    }
    for path in d.values():
        shutil.copytree(root / "data", path)
    d["logits"] = str(root / "logits.pt")
    out: dict = {"dirs": d}
    out.update(
        run_eager(f"""
emit("eager", train(cfg({d["eager"]!r}, {overrides("cpu", 8, 10, save_every=5)!r}), evaluate))
emit("eager_adamw", train(cfg({d["eager_adamw"]!r}, {overrides("cpu", 8, 5, optimizer="adamw")!r}),
                          evaluate))
""")
    )
    copy_checkpoint(d["eager"], d["resume_xla"], 5)
    fsdp4 = (
        CAPTURE
        + f"""
import torch_xla
import torch_xla.debug.metrics as met
emit("fsdp4", train(cfg({d["fsdp4"]!r}, {fsdp(10, 0, save_every=5)!r}), evaluate))
emit("fsdp4_compiles", met.metric_data("CompileTime")[0])
emit("fsdp4_layout", layout())
tokens = torch.randint(0, captured["model"].vocab_size, (4, 16),
                       generator=torch.Generator().manual_seed(7))
with torch.no_grad():   # the live sharded model (step 10) on fixed tokens, for the export test
    logits = captured["model"](tokens.to(torch_xla.device()))
torch.save({{"tokens": tokens, "logits": logits.cpu()}}, {d["logits"]!r})
emit("resume_xla", train(cfg({d["resume_xla"]!r}, {fsdp(10, 0, eval_every=0)!r}), evaluate))
emit("resume_xla_layout", layout())
"""
    )
    fsdp2 = (
        CAPTURE
        + f"""
emit("fsdp2", train(cfg({d["fsdp2"]!r}, {fsdp(5, 2, optimizer="adamw", eval_every=0)!r}), evaluate))
emit("fsdp2_layout", layout())
"""
    )
    # two XLA processes at once: compiles are mostly single-threaded
    with ThreadPoolExecutor(2) as pool:
        for job in [pool.submit(run_xla_script, script, DEVICES) for script in (fsdp4, fsdp2)]:
            out.update(job.result())
    copy_checkpoint(d["fsdp4"], d["resume_eager"], 5)
    out.update(
        run_eager(f"""
emit("resume_eager", train(cfg({d["resume_eager"]!r}, {overrides("cpu", 8, 10, eval_every=0)!r}),
                           evaluate))
""")
    )
    return out


def _tiny_specs(shard: int) -> dict[str, tuple]:
    """The partition specs train/xla/sharding.py plans for the runs' model over `shard` devices,
    its block weights stacked over the layers as the XLA backend keeps them."""
    from dataclasses import replace

    from codex.core.config import build_config
    from codex.model.gpt import build_model
    from codex.train.xla.layer_scan import stack_blocks
    from tests.fixtures.runs import VOCAB

    model_cfg = build_config(model="tiny").model
    model = build_model(replace(model_cfg, vocab_size=VOCAB), seed=0)
    stack_blocks(model)
    return model_specs(model, shard)


def check_layout(layout: dict, shard: int) -> int:
    """Every parameter and each of its optimizer state tensors is sharded as planned: each of the 4
    devices holds the planned dim divided by `shard`. Returns the number of state tensors
    checked."""
    n_state = 0
    specs = _tiny_specs(shard)
    assert set(specs) == set(layout["params"])
    for name, p in layout["params"].items():
        spec = specs[name]
        assert "fsdp" in spec, (
            f"{name}: every tensor of the tiny model has a dim divisible by {shard}"
        )
        local = [
            s if axis is None else s // shard for s, axis in zip(p["shape"], spec, strict=True)
        ]
        assert [list(s) for s in p["local"]] == [local] * DEVICES, (name, p)
        assert p["state"], f"{name} has no optimizer state"
        for key, st in p["state"].items():
            assert st["sharding"] == p["sharding"], (name, key, st["sharding"], p["sharding"])
            assert [list(s) for s in st["local"]] == [local] * DEVICES, (name, key, st)
            n_state += 1
    return n_state


def test_param_spec_rule():
    assert param_spec((384, 128), 4) == ("fsdp", None)  # dim 0 when it divides
    assert param_spec((6, 8), 4) == (None, "fsdp")  # else the first dim that does
    assert param_spec((6, 3), 4) == (None, None)  # else replicated
    assert param_spec((128,), 2) == ("fsdp",)
    assert param_spec((8, 8), 1) == (None, None)  # one device per copy: nothing to shard
    assert param_spec((384, 128), 4, first=1) == (None, "fsdp")  # the dim asked for first
    assert param_spec((384, 6), 4, first=1) == ("fsdp", None)  # else the rule above


@pytest.mark.parametrize("tie", [False, True])
def test_model_specs_shard_tables_and_head_on_their_width(tie):
    """Embedding tables (wte, value embeddings) and the head on their width, tied or not; the
    MLP's down projection [width, hidden] on its hidden dim; every other matrix on its first dim
    that is not the width; norms on their only dim (train/xla/sharding.py: model_specs)."""
    from codex.core.config import build_config
    from codex.model.gpt import build_model

    overrides = ["model.vocab_size=512", "model.value_embed=true", f"model.tie_embeddings={tie}"]
    model = build_model(build_config(model="tiny", overrides=overrides).model, seed=0)
    specs = model_specs(model, 4)
    assert specs["wte.weight"] == (None, "fsdp")
    assert ("lm_head.weight" in specs) == (not tie)  # a tied head is the table, named once
    assert specs.get("lm_head.weight", (None, "fsdp")) == (None, "fsdp")
    tables = [n for n in specs if n.startswith("value_embeds.")]
    assert tables and all(specs[n] == (None, "fsdp") for n in tables)
    block = {n.split(".", 2)[2]: spec for n, spec in specs.items() if n.startswith("blocks.0.")}
    assert block["mlp.w_down.weight"] == (None, "fsdp")
    assert block["mlp.w_up.weight"] == block["attn.c_k.weight"] == ("fsdp", None)
    assert block["attn_norm.weight"] == ("fsdp",)


def test_fsdp4_and_fsdp2x2_match_eager_after_5_steps(runs):
    d = runs["dirs"]
    assert runs["fsdp4"]["world_size"] == runs["fsdp2"]["world_size"] == DEVICES
    diff = max_diff(model_at(d["fsdp4"], 5), model_at(d["eager"], 5))
    assert diff < 1e-4, f"XLA fsdp=4 vs eager after 5 steps: max abs diff {diff:.3g}"
    assert max_diff(model_at(d["fsdp4"], 5), model_at(d["fsdp4"], 10)) > 1e-3  # it trained
    assert max_diff(model_at(d["fsdp4"], 10), model_at(d["eager"], 10)) < 1e-4
    # validation under fsdp
    assert abs(runs["fsdp4"]["val_loss"] - runs["eager"]["val_loss"]) < 1e-4
    diff = max_diff(model_at(d["fsdp2"], 5), model_at(d["eager_adamw"], 5))
    assert diff < 1e-4, (
        f"XLA fsdp=2 x replica=2 (AdamW) vs eager after 5 steps: max abs diff {diff:.3g}"
    )


def test_parameters_and_optimizer_state_are_sharded_as_planned(runs):
    n4 = check_layout(runs["fsdp4_layout"], 4)  # Muon momenta + AdamW moments
    n2 = check_layout(runs["fsdp2_layout"], 2)  # AdamW moments of every parameter
    params = runs["fsdp2_layout"]["params"]
    assert n2 == 2 * len(params) and n4 > len(params)
    for p in params.values():  # fsdp=2 x replica=2: each half on two devices
        assert "last_tile_dim_replicate" in p["sharding"]
    # The state the first step creates is marked then (where propagation did not already give it the
    # sharding), never again on later steps.
    for name, n in (("fsdp4_layout", n4), ("fsdp2_layout", n2)):
        marks = runs[name]["marks"]
        assert sum(marks) <= n and not any(marks[4:]), (name, marks)


def test_xla_fsdp_checkpoint_resumes_on_eager_and_back(runs):
    d = runs["dirs"]
    # XLA fsdp step 5 -> eager CPU to step 10: the uninterrupted eager run's parameters.
    assert runs["resume_eager"]["step"] == 10
    assert max_diff(model_at(d["resume_eager"], 10), model_at(d["eager"], 10)) < 1e-4
    # eager step 5 -> XLA fsdp=4 to step 10; the loaded optimizer state arrives sharded (the
    # checkpoint load puts each tensor on the devices with its parameter's sharding, never whole),
    # so the step hooks find nothing to re-mark, and every tensor is sharded as planned.
    assert runs["resume_xla"]["step"] == 10
    assert max_diff(model_at(d["resume_xla"], 10), model_at(d["eager"], 10)) < 1e-4
    layout = runs["resume_xla_layout"]
    assert check_layout(layout, 4) > 0
    assert sum(layout["marks"]) == 0, layout["marks"]


def test_export_gives_the_live_sharded_models_logits(runs, tmp_path):
    """`codex export`'s file (torch.load(weights_only=True)) in a fresh model gives the logits the
    live XLA fsdp=4 model gave at the same step."""
    from codex.core.config import build_config
    from codex.core.config.model import ModelConfig
    from codex.model.export_torch import export_torch
    from codex.model.gpt import GPT
    from codex.train.checkpoint.read import read_checkpoint

    d = runs["dirs"]
    out = str(tmp_path / "model.pt")
    info = export_torch(*read_checkpoint(build_config(overrides=[], run=d["fsdp4"]), 10), out)
    assert info["step"] == 10
    saved = torch.load(out, weights_only=True)
    model = GPT(ModelConfig(**saved["model_config"]))
    model.load_state_dict(saved["model"])
    live = torch.load(d["logits"], weights_only=True)
    with torch.no_grad():
        logits = model(live["tokens"])
    live = live["logits"]
    assert logits.shape == live.shape == (4, 16, saved["model_config"]["vocab_size"])
    assert (logits - live).abs().max().item() < 1e-4
    assert (logits - live).abs().max().item() < 1e-3 * live.abs().max().item()


def test_xla_fsdp_compiles_what_replicate_compiles(runs):
    """Sharding adds no program: the 10-step run (log every 5, validation at 10) compiles the six
    of tests/train/xla/test_xla.py's replicated run (first step, steady step, loss read, loss
    zeroing, two
    validation graphs); the state marked after the first step feeds the steady step unchanged."""
    from tests.fixtures.xla import EXPECTED_COMPILES

    assert runs["fsdp4_compiles"] == EXPECTED_COMPILES


def test_auto_picks_fsdp_on_tpu_and_refusals():
    """train.parallel=auto on a TPU preset where the replicated state does not fit gives fsdp over
    the slice; fsdp under --xla-mode spawn is refused (exit 2), before any device work."""
    from codex.core.config import ConfigError, build_config
    from codex.core.config.model import ModelConfig
    from codex.train.plan.layout import Layout
    from codex.train.plan.presets import get_preset
    from codex.train.xla.backend import XLABackend
    from tests.fixtures.runs import plan_without_run

    preset = get_preset("v5litepod-4")
    layout = plan_without_run(
        build_config(model="1b", overrides=["train.hardware=v5litepod-4"]), preset, 4
    ).layout
    assert (layout.parallel, layout.shard, layout.replicas) == ("fsdp", 4, 1)
    layout = plan_without_run(
        build_config(model="tiny", overrides=["train.hardware=v5litepod-4"]), preset, 4
    ).layout
    assert layout.parallel == "replicate"
    tiny = ModelConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=32, vocab_size=64, max_seq_len=16)
    base = dict(
        device=torch.device("cpu"),
        rank=0,
        world_size=4,
        local_rank=0,
        autocast_dtype=None,
        loader_rank=0,
        devices_per_loader=4,
        global_values=True,
    )
    backend = XLABackend(mode="spawn", loader_world=1, **base)
    with pytest.raises(ConfigError, match="train.parallel=fsdp on TPU runs under --xla-mode spmd"):
        backend.build_model(tiny, 0, Layout("fsdp", shard=4, replicas=1))


PHASED = """
import numpy as np
import torch_xla, torch_xla.runtime as xr
from codex.train.xla.reduce_scatter import _at_most_8, _phase_groups, reduced_weight_grad
from codex.train.xla.reduce_scatter import phases, set_phases
from codex.train.xla.sharding import annotate, batch_spec, make_mesh
xr.use_spmd()
g = torch.Generator().manual_seed(0)
a, b = torch.randn(64, 8, generator=g), torch.randn(64, 12, generator=g)
out = {}
for replicas, shard, per_host, spec in [(1, 4, 2, ("fsdp", None)), (1, 4, 4, (None, "fsdp")),
                                        (2, 2, 1, ("fsdp", None))]:
    mesh = make_mesh(replicas, shard)
    set_phases(mesh, per_host)
    ad, bd = a.to(torch_xla.device()), b.to(torch_xla.device())
    annotate(ad, mesh, batch_spec(2)); annotate(bd, mesh, batch_spec(2))
    got = reduced_weight_grad(ad, bd, mesh, spec, phases(mesh))
    sharding = torch_xla._XLAC._get_xla_sharding_spec(got)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([got])
    out[f"{replicas}x{shard}/{per_host}/{spec.index('fsdp')}"] = {
        "diff": (got.cpu() - a.t() @ b).abs().max().item(), "phases": phases(mesh),
        "scatters": hlo.count(" reduce-scatter("), "all_reduces": hlo.count(" all-reduce("),
        "sharding": sharding}
out["groups"] = [s for s in _phase_groups(np.arange(8).reshape(1, 8), (2, 4))]
out["split"] = [_at_most_8(n) for n in (8, 16, 64, 12)]
emit("phased", out)
"""


@pytest.mark.slow
def test_reduced_weight_grad_sums_every_devices_tokens_in_phases():
    """reduced_weight_grad on 4 XLA CPU devices (train/xla/reduce_scatter.py): a^T b of the tokens
    spread over every device, reduce-scattered to the weight's sharding in two phases (2 hosts of
    2 chips), in one (one host), on the weight's second dim, and with 2 replicas (a
    reduce-scatter over fsdp, then an all-reduce of the shard): equal to the product on the host
    each time, sharded as asked."""
    out = run_xla_script(PHASED, devices=DEVICES)["phased"]
    two, one, replicas = (out[k] for k in ("1x4/2/0", "1x4/4/1", "2x2/1/0"))
    for case in (two, one, replicas):
        assert case["diff"] < 1e-4, out
    assert (two["phases"], two["scatters"], two["all_reduces"]) == ([2, 2], 2, 0), two
    assert (one["phases"], one["scatters"], one["all_reduces"]) == ([4], 1, 0), one
    assert (replicas["scatters"], replicas["all_reduces"]) == (1, 1), replicas
    assert "devices=[4,1]" in two["sharding"], out  # dim 1's: the transpose of such a shard
    # 8 devices as 2 hosts of 4: across the hosts (the same chip of each), then within a host
    across, within = [2, [[0, 4], [1, 5], [2, 6], [3, 7]]], [4, [[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert out["groups"] == [across, within]
    # no phase of more than 8 (16 hosts' one was an all-reduce on v6e:8x8)
    assert out["split"] == [[8], [4, 4], [8, 8], [3, 4]], out["split"]
