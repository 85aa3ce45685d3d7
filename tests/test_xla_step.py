"""train.xla_step=cached (train/xla/step.py) against the Python micro-batch loop, on the XLA CPU
backend: the same gradients and losses step after step, with the model's Python forward run once
per run instead of once per micro-batch. The whole-loop checks (4-device SPMD parity with eager,
the fixed compile count over 1,000 steps, fsdp) run the cached step too: it is the default.

Run in the XLA venv:  PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla tests/test_xla_step.py
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_xla
from tests.test_xla import results

pytestmark = pytest.mark.xla

SCRIPT = """
import json
import torch
torch.set_num_threads(1)
import torch_xla
from codex.config.model import ModelConfig
from model.gpt import build_model
from train.remat import apply_remat
from train.xla.step import DeviceAccumulation

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

    from train.xla.flash import make_flash_attend
    from train.xla.sharding import per_device_trace

    calls = []
    monkeypatch.setattr(
        ck, "flash_attention", lambda *a, **kw: calls.append((kw["partition_spec"], kw["mesh"]))
    )

    class Mesh:
        axis_names = ("replica", "fsdp")

    mesh = Mesh()
    attend = make_flash_attend(mesh)
    q = torch.zeros(2, 4, 8, 16)
    attend(q, q, q)
    with per_device_trace():
        attend(q, q, q)
    attend(q, q, q)
    spec = (("replica", "fsdp"), None, None, None)
    assert calls == [(spec, mesh), (None, None), (spec, mesh)]
