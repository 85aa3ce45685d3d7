"""train/optim/muon.py: the orthogonalisation against an SVD, which parameters Muon takes, its
learning rate under the schedule, 1 process = 2 processes (gloo) = accumulation 2, and an exact
resume."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from codex.core.config import ConfigError, build_config
from codex.model.gpt import build_model
from codex.train.checkpoint import folders as checkpoint
from codex.train.optim.muon import Muon, Optimizers, orthogonalize
from codex.train.optim.optimizer import make_optimizer
from codex.train.optim.schedule import set_lr
from tests.test_train import (
    KILL_AT_SAVE,
    ROOT,
    assert_close,
    final_model,
    one_thread,  # noqa: F401 (autouse)
    run_train,
    train_cli_args,
)
from tests.train_helpers import base_overrides, child_env, make_run

MUON = dict(optimizer="muon", muon_lr=0.02)


@pytest.mark.parametrize("shape", [(32, 32), (16, 48), (48, 16), (3, 8, 24)])
def test_orthogonalize_matches_the_svd_factor_within_the_methods_band(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = orthogonalize(g.float()).double()
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    # x = U diag(s') V^T with the same singular vectors as g: U^T x V is diagonal...
    core = u.mT @ x @ vh.mT
    diag = torch.diagonal(core, dim1=-2, dim2=-1)
    off = core - torch.diag_embed(diag)
    assert off.abs().max() < 0.05, off.abs().max()
    # ...and the quintic's coefficients put every singular value in about [0.7, 1.2], never
    # exactly 1.
    assert diag.min() > 0.6 and diag.max() < 1.2, (diag.min(), diag.max())
    assert (diag - 1).abs().max() > 1e-3


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    cfg = build_config(overrides=base_overrides(**MUON, lr=0.004))
    cfg.model.vocab_size = 300
    model = build_model(cfg.model, seed=0)
    opt = make_optimizer(model, cfg.train)
    assert isinstance(opt, Optimizers) and isinstance(opt.optimizers["muon"], Muon)
    muon_ids = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    adam_ids = {id(p) for g in opt.optimizers["adamw"].param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert not muon_ids & adam_ids and muon_ids | adam_ids == set(names)
    assert {names[i] for i in muon_ids} == {
        n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2
    }
    assert all("norm" in names[i] or not names[i].startswith("blocks.") for i in adam_ids)
    # The schedule scales both peaks alike: at half of train.lr, Muon is at half of muon_lr.
    set_lr(opt, 0.002)
    assert {g["lr"] for g in opt.optimizers["adamw"].param_groups} == {0.002}
    assert [g["lr"] for g in opt.optimizers["muon"].param_groups] == [pytest.approx(0.01)]


@pytest.mark.slow
def test_muon_one_process_two_processes_and_accumulation_agree(tmp_path):
    runs = {name: make_run(tmp_path / name) for name in ("big", "accum", "ddp")}
    steps = dict(max_steps=5, save_every=5, lr=1e-3, **MUON)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "codex.cli",
        "--",
        "train",
        *train_cli_args(runs["ddp"], device_batch=4, **steps),
    ]
    proc = subprocess.run(
        cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    big = run_train(runs["big"], device_batch=8, **steps)
    acc = run_train(runs["accum"], device_batch=4, batch_tokens=8 * 16, **steps)
    assert (big["accum"], acc["accum"]) == (1, 2)
    m_big, m_acc, m_ddp = (final_model(runs[n]) for n in ("big", "accum", "ddp"))
    assert_close(m_big, m_acc, 1e-5)
    assert_close(m_big, m_ddp, 1e-5)


def test_muon_sigkill_then_resume_is_bitwise_identical(tmp_path):
    steps = dict(max_steps=6, save_every=2, device_batch=4, batch_tokens=128, **MUON)  # accum 2
    ref_run, run = make_run(tmp_path / "ref"), make_run(tmp_path / "killed")
    run_train(ref_run, **steps)
    script = KILL_AT_SAVE.format(kill_step=4, args=train_cli_args(run, **steps))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert checkpoint.latest_step(run) == 2
    assert run_train(run, **steps)["step"] == 6
    a, b = checkpoint.load(ref_run), checkpoint.load(run)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for which in ("muon", "adamw"):
        assert a["optimizer"][which]["state"], which
        for pid, st in a["optimizer"][which]["state"].items():
            for name, t in st.items():
                assert torch.equal(t, b["optimizer"][which]["state"][pid][name]), (which, pid, name)


def _sharded_muon_step(rank: int, world: int, port: int, out: str) -> None:
    """One Muon step on rank `rank` of a real gloo group; records which matrices it
    orthogonalised."""
    import torch.distributed as dist

    import codex.train.optim.muon as muon_module

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    done = []
    plain = muon_module.orthogonalize
    muon_module.orthogonalize = lambda g, *a: done.append(tuple(g.shape)) or plain(g, *a)
    params = _muon_problem()
    opt = Muon(params, lr=0.1, shard_across=(rank, world))
    opt.step()
    torch.save(
        {"orthogonalized": done, "params": [p.detach() for p in params]}, f"{out}/rank{rank}.pt"
    )
    dist.destroy_process_group()


def _muon_problem() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    # 5 matrices over 2 ranks: shares of 3 and 2
    shapes = [
        (8, 8),
        (16, 8),
        (8, 24),
        (12, 12),
        (4, 4),
    ]
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def test_replicated_ranks_share_out_the_orthogonalisation_and_end_equal(tmp_path):
    import torch.multiprocessing as mp

    from tests.conftest import _free_port

    mp.spawn(_sharded_muon_step, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # Rank 0 took matrices 0, 2, 4 and rank 1 matrices 1, 3: each orthogonalised once in all.
    assert ranks[0]["orthogonalized"] == [(8, 8), (8, 24), (4, 4)]
    assert ranks[1]["orthogonalized"] == [(16, 8), (12, 12)]
    reference = _muon_problem()
    Muon(reference, lr=0.1).step()
    for r in ranks:
        for got, want in zip(r["params"], reference, strict=True):
            assert torch.equal(got, want.detach())


def test_resuming_with_another_optimizer_is_refused(tmp_path):
    run = make_run(tmp_path / "run")
    run_train(run, max_steps=2, save_every=2, **MUON)
    with pytest.raises(ConfigError, match="train.optimizer=muon"):
        run_train(run, max_steps=4, save_every=2, optimizer="adamw")
    assert Path(checkpoint.step_dir(run, 2)).exists() and checkpoint.latest_step(run) == 2


def _fsdp_muon_step(rank: int, world: int, port: int, out: str) -> None:
    """Two Muon steps over matrices sharded on dim 0 (DTensors on a 1-D gloo mesh, as FSDP2
    holds them); records which matrices this rank orthogonalised."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import codex.train.optim.muon as muon_module

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    done = []
    plain = muon_module.orthogonalize
    muon_module.orthogonalize = lambda g, *a: done.append(tuple(g.shape)) or plain(g, *a)
    full = _uneven_problem()
    params = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in full]
    opt = Muon(params, lr=0.1)
    for step in range(2):
        for p, f in zip(params, full, strict=True):
            p.grad = distribute_tensor(f.grad * (step + 1), mesh, [Shard(0)])
        opt.step()
    torch.save(
        {"orthogonalized": done, "params": [p.full_tensor().detach() for p in params]},
        f"{out}/rank{rank}.pt",
    )
    dist.destroy_process_group()


def _uneven_problem() -> list[torch.nn.Parameter]:
    """Matrices whose rows split unevenly over 2 ranks, one leaving rank 1 no rows at all."""
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(*s, generator=gen))
        for s in [(8, 8), (16, 8), (5, 24), (12, 12), (1, 6)]
    ]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def test_fsdp_ranks_orthogonalise_each_matrix_once_on_its_owner_and_match_one_process(tmp_path):
    """train.parallel=fsdp: each sharded matrix is orthogonalised once in the job, on rank
    i mod W (before: every rank gathered and orthogonalised every matrix), and the weights equal
    one process's after 2 steps."""
    import torch.multiprocessing as mp

    from tests.conftest import _free_port

    mp.spawn(_fsdp_muon_step, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # whole matrices, each on its owner: 3 on rank 0, 2 on rank 1, twice (2 steps)
    assert ranks[0]["orthogonalized"] == [(8, 8), (5, 24), (1, 6)] * 2
    assert ranks[1]["orthogonalized"] == [(16, 8), (12, 12)] * 2
    reference = _uneven_problem()
    opt = Muon(reference, lr=0.1)
    grads = [p.grad.clone() for p in reference]
    for step in range(2):
        for p, g in zip(reference, grads, strict=True):
            p.grad = g * (step + 1)
        opt.step()
    for r in ranks:
        for got, want in zip(r["params"], reference, strict=True):
            assert (got - want.detach()).abs().max().item() <= 1e-6
