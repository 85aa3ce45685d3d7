"""train.xla_step=cached (train/xla/step.py) against the Python micro-batch loop, on the XLA CPU
backend: the same gradients and losses step after step, with the model's Python forward run once
per run instead of once per micro-batch. The whole-loop checks (4-device SPMD parity with eager,
the fixed compile count over 1,000 steps, fsdp) run the cached step too: it is the default.

Run in the XLA venv:  PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla
tests/train/xla/test_xla_step.py
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.procs import run_xla
from tests.fixtures.xla import results

pytestmark = pytest.mark.xla

SCRIPT = """
import json
import torch
torch.set_num_threads(1)
import torch_xla
from codex.core.config.model import ModelConfig
from codex.model.gpt import build_model
from codex.train.remat import apply_remat
from codex.train.xla.step import DeviceAccumulation

ACCUM, STEPS = 3, 3
cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=300, max_seq_len=16)
g = torch.Generator().manual_seed(1)
# [rows, accum, T + 1]
data = [torch.randint(0, 300, (2, ACCUM, 17), generator=g) for _ in range(STEPS)]
dev = torch_xla.device()
out = {}
for mode in ("traced", "cached", "cached_remat"):
    model = apply_remat(build_model(cfg, seed=0), "block" if mode.endswith("remat") else "none",
                        "tpu").to(dev)
    calls = []
    def loss_fn(x, y):
        calls.append(1)
        return model(x, y)
    accumulation = DeviceAccumulation(model, loss_fn, ACCUM)
    losses = []
    for batch in data:
        x, y = batch[:, :, :-1].to(dev), batch[:, :, 1:].to(dev)
        if mode == "traced":
            total = 0
            for i in range(ACCUM):
                loss = loss_fn(x[:, i], y[:, i])
                (loss / ACCUM).backward()
                total = total + loss.detach()
        else:
            total = accumulation(x, y)
        with torch.no_grad():   # plain SGD: every step sees new parameters
            for p in model.parameters():
                p -= 0.5 * p.grad
                p.grad = None
        torch_xla.sync()
        losses.append(total.item())
    out[mode] = {"losses": losses, "calls": len(calls),
                 "params": {n: p.detach().cpu().tolist() for n, p in model.named_parameters()}}

class Noisy(torch.nn.Module):   # draws random numbers in its forward: not a pure body
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
    def forward(self, x, y):
        return (self.w * torch.rand(4, device=x.device)).sum() + 0 * x.float().sum()

noisy = Noisy().to(dev)
try:
    DeviceAccumulation(noisy, noisy, 2)(torch.zeros(1, 2, 4, device=dev),
                                        torch.zeros(1, 2, 4, device=dev))
    out["refused"] = ""
except RuntimeError as e:
    out["refused"] = str(e)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def step_runs() -> dict:
    return results(run_xla(SCRIPT, devices=1, env={"OMP_NUM_THREADS": "1"}))


def test_cached_step_matches_the_python_loop_and_traces_once(step_runs):
    traced = step_runs["traced"]
    # the Python loop runs the forward for every micro-batch of every step
    assert traced["calls"] == 3 * 3
    for mode in ("cached", "cached_remat"):
        run = step_runs[mode]
        assert run["calls"] == 1, mode  # traced on the first step, replayed after
        assert run["losses"] == pytest.approx(traced["losses"], rel=1e-6, abs=1e-6), mode
        assert traced["losses"][0] != traced["losses"][-1]  # the parameters really moved
        for name, p in traced["params"].items():
            diff = (torch.tensor(p) - torch.tensor(run["params"][name])).abs().max().item()
            assert diff <= 1e-6, (mode, name, diff)


def test_cached_step_refuses_a_forward_that_draws_random_numbers(step_runs):
    # A While replaying one traced body would reuse the first step's random numbers every step.
    assert (
        "deterministic forward" in step_runs["refused"]
        and "xla_step=traced" in step_runs["refused"]
    )


def test_flash_kernel_gets_no_mesh_inside_the_per_device_trace(monkeypatch):
    """The cached step traces its per-device body inside sharding.per_device_trace(): there the
    flash kernel gets one chip's q, k, v with no mesh and no partition spec; elsewhere (validation,
    the traced step) the mesh and the batch spec over both axes."""
    import torch_xla.experimental.custom_kernel as ck

    from codex.train.xla.flash import make_flash_attend
    from codex.train.xla.sharding import per_device_trace

    calls = []
    monkeypatch.setattr(
        ck, "flash_attention", lambda *a, **kw: calls.append((kw["partition_spec"], kw["mesh"]))
    )

    class Mesh:
        axis_names = ("replica", "fsdp")

    mesh = Mesh()
    attend = make_flash_attend(mesh)
    q = torch.zeros(2, 4, 128, 16)
    attend(q, q, q)
    with per_device_trace():
        attend(q, q, q)
    attend(q, q, q)
    spec = (("replica", "fsdp"), None, None, None)
    assert calls == [(spec, mesh), (None, None), (spec, mesh)]
    # below 128 positions the kernel's trace fails: blockwise attention runs instead
    short = torch.randn(2, 4, 8, 16)
    out = attend(short, short, short)
    assert len(calls) == 3 and out.shape == short.shape


UPDATE_SCRIPT = """
import json
import torch
torch.set_num_threads(1)
from codex.train.plan.world import set_xla_import_env
set_xla_import_env()
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr
from codex.core.config import build_config
from codex.core.config.model import ModelConfig
from codex.model.gpt import build_model
from codex.train.optim.optimizer import clip_grad_norm, make_optimizer
from codex.train.optim.schedule import set_lr
from codex.train.xla import sharding
from codex.train.xla.update import CachedUpdate

xr.use_spmd()
dev = torch_xla.device()
cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=300, max_seq_len=16)
g = torch.Generator().manual_seed(1)
data = [torch.randint(0, 300, (8, 17), generator=g) for _ in range(5)]
LRS = [1e-3, 4e-3, 1e-2, 6e-3, 2e-3]   # a warmup and a decay: the lr must be an input
out = {}
for optimizer_name in ("muon", "adamw"):
    tcfg = build_config(model="tiny", overrides=[f"train.optimizer={optimizer_name}",
                                                  "train.lr=0.01", "train.grad_clip=0.5"]).train
    for parallel in ("replicate", "fsdp"):
        for mode in ("traced", "cached"):
            model = build_model(cfg, seed=0)
            mesh = sharding.make_mesh(1, 4)
            if parallel == "fsdp":
                sharding.shard_model(model, mesh, dev)
            model = model.to(dev)
            opt = make_optimizer(model, tcfg, "tpu")
            update = CachedUpdate(model, opt, tcfg.grad_clip)
            torch_xla.sync()
            c0 = met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0
            norms = []
            for batch, lr in zip(data, LRS):
                x, y = batch[:, :-1].to(dev), batch[:, 1:].to(dev)
                model(x, y).backward()
                set_lr(opt, lr)
                if mode == "traced":
                    norm = clip_grad_norm(model, tcfg.grad_clip)
                    opt.step()
                else:
                    norm = update(lr)
                opt.zero_grad(set_to_none=True)
                torch_xla.sync()
                norms.append(norm.item())
            c1 = met.metric_data("CompileTime")[0]
            opts = getattr(opt, "optimizers", {"": opt}).values()
            state = [v for o in opts for st in o.state.values() for v in st.values()]
            out[f"{optimizer_name}/{parallel}/{mode}"] = {
                "norms": norms, "traces": update.traces, "compiles": c1 - c0,
                "params": {n: p.detach().cpu().tolist() for n, p in model.named_parameters()},
                "shardings": sorted({sharding.sharding_of(t) for t in [*model.parameters(), *state]
                                     if t.dim() == 2}),
            }
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def update_runs() -> dict:
    return results(run_xla(UPDATE_SCRIPT, devices=4, env={"OMP_NUM_THREADS": "1"}))


@pytest.mark.parametrize("parallel", ["replicate", "fsdp"])
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_cached_update_matches_clip_and_step_and_traces_once(update_runs, optimizer, parallel):
    """train/xla/update.py: clip + optimizer.step traced on the first step only, with the
    learning rate an input (it changes every step here), the same parameters and gradient norms
    as the traced update, no more programs compiled, and the fsdp shardings kept."""
    traced = update_runs[f"{optimizer}/{parallel}/traced"]
    cached = update_runs[f"{optimizer}/{parallel}/cached"]
    assert cached["traces"] == 1 and traced["traces"] == 0
    assert cached["norms"] == pytest.approx(traced["norms"], rel=1e-5)
    assert traced["norms"][0] > 0.5  # clipping was active
    # one program vs two fused differently: ulp-level differences, which Adam's first steps at
    # lr 1e-2 turn into lr-sized ones where a gradient entry is near zero
    # (tests/train/xla/test_xla.py)
    for name, p in traced["params"].items():
        diff = (torch.tensor(p) - torch.tensor(cached["params"][name])).abs().max().item()
        assert diff <= 1e-4, (name, diff)
    assert cached["compiles"] <= traced["compiles"]
    assert cached["shardings"] == traced["shardings"]
    if parallel == "fsdp":
        assert any("devices=" in s for s in cached["shardings"]), cached["shardings"]
