"""train/optim/muon.py: the orthogonalisation against an SVD, which parameters Muon takes, its
learning rate under the schedule, 1 process = 2 processes (gloo) = accumulation 2, an exact
resume, the stacked iteration (once per shape group and step, equal to the per-matrix updates on
every preset's shapes) and how 2 gloo ranks share it (replicated and fsdp: each matrix on its
owner only)."""

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
from codex.train.optim.muon import (
    Muon,
    Optimizers,
    balanced_owners,
    newton_schulz,
    orthogonalize,
    wide,
)
from codex.train.optim.optimizer import make_optimizer
from codex.train.optim.schedule import set_lr
from tests.fixtures import ROOT
from tests.fixtures.runs import (
    KILL_AT_SAVE,
    assert_close,
    base_overrides,
    child_env,
    final_model,
    make_run,
    run_train,
    train_cli_args,
)

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


@pytest.mark.slow
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


def test_resuming_with_another_optimizer_is_refused(tmp_path):
    run = make_run(tmp_path / "run")
    run_train(run, max_steps=2, save_every=2, **MUON)
    with pytest.raises(ConfigError, match="train.optimizer=muon"):
        run_train(run, max_steps=4, save_every=2, optimizer="adamw")
    assert Path(checkpoint.step_dir(run, 2)).exists() and checkpoint.latest_step(run) == 2


# --- stacks: one iteration per shape group, equal to the per-matrix reference ---------------------


def _reference_steps(shapes, grads, steps: int, lr: float = 1.0, momentum: float = 0.95):
    """The weights (from zeros) after `steps` Muon steps as the per-matrix code computed them: each
    matrix's Nesterov momentum orthogonalised on its own (`orthogonalize`), scaled by its aspect."""
    weights = [torch.zeros(s) for s in shapes]
    buffers = [torch.zeros(s) for s in shapes]
    for k in range(steps):
        for w, buf, g in zip(weights, buffers, grads, strict=True):
            grad = g * (k + 1)
            buf.lerp_(grad, 1 - momentum)
            update = orthogonalize(grad.lerp(buf, momentum))
            w.add_(update, alpha=-lr * max(1.0, w.size(0) / w.size(1)) ** 0.5)
    return weights


def _preset_shapes(preset: str) -> list[tuple[int, int]]:
    """The shapes of the matrices Muon takes in a model preset, in the optimizer's order (the model
    built on the meta device: no memory)."""
    from codex.model.gpt import GPT
    from codex.train.optim.muon import is_hidden_matrix

    cfg = build_config(model=preset, overrides=["model.vocab_size=256"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    return [tuple(p.shape) for n, p in model.named_parameters() if is_hidden_matrix(n, p)]


def _some_of_each_group(shapes, per_group: int) -> list[tuple[int, int]]:
    """The first `per_group` matrices of each wide-shape group, in order."""
    taken: dict[tuple[int, int], int] = {}
    out = []
    for s in shapes:
        if taken.get(wide(s), 0) < per_group:
            taken[wide(s)] = taken.get(wide(s), 0) + 1
            out.append(s)
    return out


def _count_iterations(monkeypatch) -> list[tuple[int, ...]]:
    """The stack shape of every newton_schulz call from now on."""
    import codex.train.optim.muon as muon_module

    calls: list[tuple[int, ...]] = []
    plain = muon_module.newton_schulz

    def counted(x, steps):
        calls.append(tuple(x.shape))
        return plain(x, steps)

    monkeypatch.setattr(muon_module, "newton_schulz", counted)
    return calls


def _check_against_reference(shapes, monkeypatch, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    calls = _count_iterations(monkeypatch)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = Muon(params, lr=1.0)
    for k in range(steps):
        for p, g in zip(params, grads, strict=True):
            p.grad = g * (k + 1)
        opt.step()
    # one iteration per group and step, over the whole group's stack
    groups: dict[tuple[int, int], int] = {}
    for s in shapes:
        groups[wide(s)] = groups.get(wide(s), 0) + 1
    assert calls == [(n, *shape) for shape, n in groups.items()] * steps, calls
    want = _reference_steps(shapes, grads, steps)
    for s, p, w in zip(shapes, params, want, strict=True):
        diff = (p.detach() - w).abs().max().item()
        assert diff <= 1e-5, (s, diff)


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,per_group", [("tiny", None), ("124m", 2), ("350m", 1)], ids=["tiny", "124m-2", "350m-1"]
)
def test_stacked_iteration_runs_once_per_group_and_equals_the_per_matrix_updates(
    preset, per_group, monkeypatch
):
    """Muon groups the matrices by wide shape and iterates each group once per step as one
    stack; the weights after 2 steps equal the per-matrix code's within 1e-5 (fp32). tiny: every
    matrix; 124m and 350m: the first of each group (the full presets: the slow test below)."""
    shapes = _preset_shapes(preset)
    _check_against_reference(
        shapes if per_group is None else _some_of_each_group(shapes, per_group), monkeypatch
    )


@pytest.mark.parametrize(
    "preset,per_group,steps",
    [
        pytest.param("124m", None, 2, marks=pytest.mark.heavy),
        pytest.param("350m", 2, 2, marks=pytest.mark.slow),
        pytest.param("1b", 2, 1, marks=pytest.mark.heavy),
        pytest.param("7b", 1, 1, marks=pytest.mark.heavy),
    ],
)
def test_stacked_iteration_equals_the_per_matrix_updates_on_every_presets_shapes(
    preset, per_group, steps, monkeypatch
):
    """As above on the bigger presets: 124m whole; 350m and 1b two matrices of each group, 7b
    one; 1b and 7b one step. The fp32 reference iterates 7b's 4096 x 11008 matrices on the CPU:
    minutes each, so 124m, 1b and 7b are `heavy`, run by `make test-heavy`, not `make test`."""
    shapes = _preset_shapes(preset)
    _check_against_reference(
        shapes if per_group is None else _some_of_each_group(shapes, per_group), monkeypatch, steps
    )


def test_the_presets_group_into_a_few_stacks():
    """Every block repeats its shapes, so a preset's matrices fall into three stacks whatever its
    depth (c_q and c_proj share one; w_gate and w_up are iterated transposed, beside w_down)."""
    for preset, n_layer in [("tiny", 2), ("124m", 12), ("350m", 24), ("1b", 16), ("7b", 32)]:
        groups: dict[tuple[int, int], int] = {}
        for s in _preset_shapes(preset):
            groups[wide(s)] = groups.get(wide(s), 0) + 1
        assert len(groups) <= 3 and sum(groups.values()) == 7 * n_layer, (preset, groups)


def test_stacked_svd_band_matches_one_matrix_at_a_time():
    g = torch.randn(3, 8, 24, generator=torch.Generator().manual_seed(0))
    stacked = newton_schulz(g.clone(), 5)
    for i in range(3):
        assert (stacked[i] - orthogonalize(g[i])).abs().max() < 1e-6


def test_the_iteration_compiles_as_one_graph():
    """On CUDA the stacked iteration is torch.compile'd (fullgraph): dynamo must trace it whole."""
    explained = torch._dynamo.explain(newton_schulz)(torch.randn(2, 8, 24), 5)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    cfg = build_config(overrides=base_overrides(**MUON))
    cfg.model.vocab_size = 300
    model = build_model(cfg.model, seed=0)
    assert not make_optimizer(model, cfg.train).optimizers["muon"].compiled
    cfg.train.compile = True
    assert make_optimizer(model, cfg.train, "cuda").optimizers["muon"].compiled


def test_owners_are_balanced_by_entries():
    # largest first, each to the least loaded rank (the lowest on a tie): 8 | 4, 4 | then 1
    assert balanced_owners([1, 8, 4, 4], 2) == [0, 0, 1, 1]
    assert balanced_owners([5, 5], 4) == [0, 1]  # ranks beyond the matrices own nothing
    sizes = [r * c for r, c in _preset_shapes("124m")]
    for world in (2, 3, 4, 8):
        owner = balanced_owners(sizes, world)
        load = [sum(n for n, q in zip(sizes, owner, strict=True) if q == r) for r in range(world)]
        assert max(load) - min(load) <= max(sizes), (world, load)


# --- sharing the work over 2 gloo ranks, replicated and fsdp ------------------------------------


def _shared_problem() -> list[torch.nn.Parameter]:
    """Matrices of repeated shapes (two stacks of two, one of them a tall and a wide matrix), rows
    that split unevenly over 2 ranks, and a matrix that leaves rank 1 no rows at all (fsdp)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 8), (16, 8), (5, 24), (12, 12), (1, 6), (8, 16), (8, 8), (24, 5)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def _muon_steps_on_a_rank(rank: int, world: int, port: int, out: str, layout: str) -> None:
    """Two Muon steps on rank `rank` of a real gloo group, over replicated matrices or matrices
    sharded on dim 0 (DTensors on a 1-D mesh, as FSDP2 holds them); records every stack this rank
    iterated on."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import codex.train.optim.muon as muon_module

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    stacks: list[list[torch.Tensor]] = [[], []]
    step = 0
    plain = muon_module.newton_schulz

    def recorded(x, steps):
        stacks[step].append(x.clone())  # before the iteration normalises it in place
        return plain(x, steps)

    muon_module.newton_schulz = recorded
    full = _shared_problem()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        params = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in full]
        opt = Muon(params, lr=0.1)
    else:
        params = [torch.nn.Parameter(p.detach().clone()) for p in full]
        opt = Muon(params, lr=0.1, shard_across=(rank, world))
    for step in range(2):
        for p, f in zip(params, full, strict=True):
            g = f.grad * (step + 1)
            p.grad = distribute_tensor(g, mesh, [Shard(0)]) if layout == "fsdp" else g
        opt.step()
    weights = [p.full_tensor() if layout == "fsdp" else p for p in params]
    torch.save({"stacks": stacks, "params": [w.detach() for w in weights]}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _which_matrices(stack: torch.Tensor, grads: list[torch.Tensor]) -> list[int]:
    """The matrix each slice of an iterated stack is: the blended gradients here are multiples of
    the gradients (every step's gradient is a multiple of the first), so the one whose wide
    orientation points the same way."""
    found = []
    for x in stack:
        cos = [
            (x * g).sum().item() / (x.norm() * g.norm()).item() if g.shape == x.shape else 0.0
            for g in (g.mT if g.size(0) > g.size(1) else g for g in grads)
        ]
        assert max(cos) > 0.9999, cos
        found.append(max(range(len(grads)), key=cos.__getitem__))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicate", "fsdp"])
def test_ranks_orthogonalise_each_matrix_once_on_its_owner_and_match_one_process(tmp_path, layout):
    """On 2 gloo ranks, replicated (every rank holds the whole gradient; the updates all_gathered)
    and fsdp (row shards; two all_to_alls): every matrix is iterated on by exactly one rank per
    step, the one balanced_owners gives it, in one stack per group that rank owns matrices of; the
    weights after 2 steps equal one process's within 1e-6."""
    import torch.multiprocessing as mp

    from tests.fixtures.procs import free_port

    mp.spawn(_muon_steps_on_a_rank, args=(2, free_port(), str(tmp_path), layout), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reference = _shared_problem()
    grads = [p.grad for p in reference]
    owner = balanced_owners([p.numel() for p in reference], 2)
    assert sorted(set(owner)) == [0, 1]  # both ranks work
    for step in range(2):
        done = {r: [_which_matrices(s, grads) for s in ranks[r]["stacks"][step]] for r in (0, 1)}
        for r in (0, 1):
            mine = [i for stack in done[r] for i in stack]
            assert sorted(mine) == [i for i in range(len(owner)) if owner[i] == r], (r, done)
            # one stack per group: no two stacks of a rank share a shape
            shapes = [tuple(s.shape[1:]) for s in ranks[r]["stacks"][step]]
            assert len(shapes) == len(set(shapes)), shapes
        assert any(len(s) > 1 for r in (0, 1) for s in done[r])  # some stack holds several
    opt = Muon(reference, lr=0.1)
    for step in range(2):
        for p, g in zip(reference, grads, strict=True):
            p.grad = g * (step + 1)
        opt.step()
    for r in ranks:
        for got, want in zip(r["params"], reference, strict=True):
            assert (got - want.detach()).abs().max().item() <= 1e-6


def test_stacked_block_weights_update_as_their_layers():
    """XLA fsdp keeps each block weight stacked [n_layer, ...] (train/xla/layer_scan.py:
    stack_blocks): Muon iterates a stack as its layers' matrices, AdamW's groups see a stacked
    norm as a norm, and two steps give every layer exactly the per-layer model's weights."""
    import copy

    from codex.core.config import build_config
    from codex.model.gpt import build_model
    from codex.train.optim.optimizer import make_optimizer
    from codex.train.xla.layer_scan import stack_blocks

    overrides = ["train.optimizer=muon", "train.lr=0.001", "model.vocab_size=300"]
    c = build_config(model="tiny", overrides=overrides)
    layers = build_model(c.model, seed=0)
    stacked = copy.deepcopy(layers)
    stack_blocks(stacked)
    g = torch.Generator().manual_seed(0)
    for p in layers.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    n = len(layers.blocks)
    per_layer = dict(layers.named_parameters())
    for name, p in stacked.named_parameters():
        rest = name.split(".", 1)[1]
        p.grad = (
            torch.stack([per_layer[f"blocks.{i}.{rest}"].grad for i in range(n)])
            if name.startswith("stacked_blocks.")
            else per_layer[name].grad.clone()
        )
    a, b = make_optimizer(layers, c.train), make_optimizer(stacked, c.train)
    assert [len(g["params"]) for g in b.optimizers["muon"].param_groups] == [7]
    for _ in range(2):
        a.step()
        b.step()
    got = dict(stacked.named_parameters())
    for name, p in layers.named_parameters():
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            assert torch.equal(p, got[f"stacked_blocks.{rest}"][int(i)]), name
        else:
            assert torch.equal(p, got[name]), name
