"""The compiled XLA training step, read where the claims live: the optimized HLO that XLA runs on
4 XLA CPU devices (v6e-4's mesh), dumped with --xla_dump_to by the real training loop.

Parity of final parameters cannot see where a collective runs (a gradient all-reduce once per
micro-batch gives the same numbers as one per step), so these tests count collectives inside the
step's While (once per micro-batch) and after it (once per step), and read the carried buffers.

Run in the XLA venv:
    PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla tests/test_xla_program.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_xla
from tests.hlo import Program, arrays, bytes_used, manual_inputs, parse, step_programs
from tests.test_xla import PRELUDE, overrides, results

pytestmark = pytest.mark.xla

ACCUM = 4

CHILD = """
from dataclasses import replace
from codex.model.gpt import build_model, mlp_hidden
from tests.train_helpers import VOCAB
c = cfg({run!r}, {ov!r})
emit("loss", train(c, evaluate)["loss"])
m = build_model(replace(c.model, vocab_size=VOCAB, mlp_hidden=mlp_hidden(c.model)), seed=0)
emit("param_elements", sum(p.numel() for p in m.parameters()))
emit("param_shapes", [list(p.shape) for p in m.parameters()])
from codex.train.plan.hardware import get_preset
from codex.train.plan.batch import grad_accum_steps
from codex.train.plan.memory import Setting, plan
t = c.train
accum = grad_accum_steps(t.batch_tokens, t.device_batch, t.seq_len, 4)
mp = plan(replace(c.model, vocab_size=VOCAB), get_preset("v6e-4"), t.device_batch, t.seq_len,
          Setting(layout=t.parallel, dtype=t.dtype, optimizer=t.optimizer, world=4, accum=accum))
emit("plan", {{"total": mp.total, "gradients": mp.gradients,
               "compute_weights": mp.compute_weights}})
"""


def _run(tmp: Path, name: str, **extra) -> tuple[dict, list[Program]]:
    dump = tmp / f"dump-{name}"
    ov = overrides("v6e-4", 2, 2, eval_every=0, batch_tokens=2 * 32 * 4 * ACCUM, **extra)
    proc = run_xla(
        PRELUDE + CHILD.format(run=str(tmp / f"run-{name}"), ov=ov),
        devices=4,
        env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"},
    )
    programs = step_programs(dump)
    assert programs, f"no compiled program with a While in {dump}"
    return results(proc), programs


@pytest.fixture(scope="module")
def replicate(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("hlo"), "replicate", parallel="replicate")


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    # AdamW: Muon's own gathers at the optimizer step would mix with the step's gradient
    # reduction in the counts below
    return _run(tmp_path_factory.mktemp("hlo"), "fsdp", parallel="fsdp", optimizer="adamw")


def test_replicate_reduces_once_after_the_while(replicate):
    """No gradient all-reduce inside the While; after it, every gradient element reduced exactly
    once per step (the buckets the combiner forms may differ; their sizes add up)."""
    info, programs = replicate
    for program in programs:
        collectives = program.collectives()
        inside = [c for c in collectives if c.in_loop]
        assert not inside, f"{program.path.name}: {len(inside)} collectives in the While: {inside}"
        reduced = sum(c.elements for c in collectives if c.op == "all-reduce")
        # + the loss (and nothing else of size): one reduction per gradient element
        assert info["param_elements"] <= reduced <= info["param_elements"] + 8, (
            program.path.name,
            reduced,
            info["param_elements"],
        )


def test_replicate_carries_unreduced_per_device_accumulators(replicate):
    """The While carries one fp32 accumulator per parameter, each the parameter's full shape
    (every device sums its own rows' gradient), and the batch as one device's rows."""
    info, programs = replicate
    for program in programs:
        carried = [n for dtype, n in program.while_carry() if dtype == "f32"]
        for shape in info["param_shapes"]:
            n = 1
            for d in shape:
                n *= d
            assert n in carried, (shape, program.path.name)
        s64 = [n for dtype, n in program.while_carry() if dtype == "s64"]
        # [rows per device = 2, accum, T = 32] token ids: one device's quarter of the 8 rows
        assert 2 * ACCUM * 32 in s64 and 8 * ACCUM * 32 not in s64, s64


def test_fsdp_gathers_once_before_the_while_and_reduces_once_after(fsdp):
    """fsdp on TPU is ZeRO-2 (train/xla/step.py): every sharded weight all-gathered once per step
    before the While, nothing inside it, and every gradient element reduced once after it
    (all-reduce + dynamic-slice on the CPU pipeline; a TPU pipeline may fuse it into a
    reduce-scatter, which carries the same elements)."""
    info, programs = fsdp
    P = info["param_elements"]
    for program in programs:
        collectives = program.collectives()
        inside = [c for c in collectives if c.in_loop]
        assert not inside, f"{program.path.name}: {len(inside)} collectives in the While: {inside}"
        gathered = sum(c.elements for c in collectives if c.op == "all-gather")
        reduced = sum(c.elements for c in collectives if c.op in ("all-reduce", "reduce-scatter"))
        # the 1-D weights fsdp cannot split (not divisible) stay replicated: nothing to gather
        assert 0.95 * P <= gathered <= P, (program.path.name, gathered, P)
        # + scalars: the loss, and the clip's partial norm of each sharded gradient
        assert P <= reduced <= P + 2 * len(info["param_shapes"]), (program.path.name, reduced, P)


def test_fsdp_while_carries_what_the_memory_plan_counts(fsdp):
    """The While's fp32 carry is the gathered weights and the unreduced gradient sums, each whole
    (2 x 4 P bytes), which the plan counts as its gathered weights + gradients terms; the
    compiled program's buffers (XLA's memory report) stay within the plan's total."""
    info, programs = fsdp
    P, plan = info["param_elements"], info["plan"]
    assert plan["gradients"] == plan["compute_weights"] == 4 * P
    for program in programs:
        f32 = sum(n for dtype, n in program.while_carry() if dtype == "f32")
        # beyond the 2 P: the RoPE tables and the loss, captured by the body
        assert 2 * P <= f32 <= 2.05 * P, (program.path.name, f32, P)
        assert bytes_used(program) <= plan["total"], (program.path.name, plan)


@pytest.fixture(scope="module")
def fsdp_bf16(tmp_path_factory):
    return _run(
        tmp_path_factory.mktemp("hlo"),
        "fsdp-bf16",
        parallel="fsdp",
        optimizer="adamw",
        dtype="bf16",
    )


def test_fsdp_gathers_in_bf16_under_bf16(fsdp_bf16, fsdp):
    """Under bf16 the sharded weights are cast on their shards and enter the per-device While in
    bf16 (read in the program as codex emits it: the CPU pipeline then widens every bf16 value,
    collectives included, to f32, which a TPU does not); the run trains as the fp32 one does."""
    info, programs = fsdp_bf16
    P = info["param_elements"]
    for program in programs:
        entering = manual_inputs(program)
        # the sharded weights (all but the 1-D ones fsdp cannot split) in bf16, nothing in f32
        # beyond the replicated leftovers and the captured tables
        assert 0.95 * P <= sum(n for dtype, n in entering if dtype == "bf16") <= P, entering
        assert sum(n for dtype, n in entering if dtype == "f32") <= 0.05 * P, entering
    _, fp32_programs = fsdp
    for program in fp32_programs:
        assert not [a for a in manual_inputs(program) if a[0] == "bf16"]
    # the same data and init: bf16 autocast moves the loss by well under 2%
    assert abs(info["loss"] - fsdp[0]["loss"]) < 0.02 * fsdp[0]["loss"]


def test_replicate_program_within_the_memory_plan(replicate):
    info, programs = replicate
    for program in programs:
        assert bytes_used(program) <= info["plan"]["total"], (program.path.name, info["plan"])


MUON_UPDATE = """
import sys
from collections import Counter
from codex.train.plan.hardware import set_xla_import_env
set_xla_import_env()
import torch_xla
import torch_xla.runtime as xr
from codex.model.gpt import build_model
from codex.train.optim.muon import is_hidden_matrix, wide
from codex.train.optim.optimizer import make_optimizer
from codex.train.xla import sharding
from codex.train.xla.update import CachedUpdate
xr.use_spmd()
dev = torch_xla.device()
c = build_config(model="tiny", overrides=["train.optimizer=muon", "train.lr=0.01",
                                          "model.vocab_size=300"])
model = build_model(c.model, seed=0)
if {layout!r} == "fsdp":
    sharding.shard_model(model, sharding.make_mesh(1, 4), dev)
model = model.to(dev)
g = torch.Generator().manual_seed(0)
for p in model.parameters():  # gradients as device data: the update is the only program
    p.grad = torch.randn(p.shape, generator=g).to(dev)
opt = make_optimizer(model, c.train, "tpu")
torch_xla.sync()
update = CachedUpdate(model, opt, 1.0)
for lr in (1e-3, 2e-3):
    update(lr)
    torch_xla.sync()
groups = Counter(wide(p.shape) for n, p in model.named_parameters() if is_hidden_matrix(n, p))
emit("groups", [[r, c, n] for (r, c), n in groups.items()])
emit("ns_steps", opt.optimizers["muon"].param_groups[0]["ns_steps"])
"""

_DOT = re.compile(r"=\s*\w+\[([\d,]*)\]\{[^}]*\}\s+dot\(")


@pytest.fixture(scope="module", params=["replicate", "fsdp"])
def muon_update(request, tmp_path_factory):
    dump = tmp_path_factory.mktemp("hlo") / f"dump-muon-{request.param}"
    proc = run_xla(
        PRELUDE + MUON_UPDATE.format(layout=request.param),
        devices=4,
        env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text", "OMP_NUM_THREADS": "1"},
    )
    programs = [parse(p) for p in sorted(dump.glob("*after_optimizations.txt"))]
    return results(proc), programs


def _dots(program: Program) -> list[tuple[int, int, int]]:
    """(batch, rows, cols) of every dot's result in `program`; batch 1 where XLA dropped a batch
    dim of 1."""
    out = []
    for lines in program.computations.values():
        for line in lines:
            m = _DOT.search(line)
            if m:
                dims = [int(d) for d in m.group(1).split(",")]
                out.append(tuple([1] * (3 - len(dims)) + dims))
    return out


def test_muon_iterates_on_a_quarter_of_each_stack_per_device(muon_update):
    """Default Muon (train/xla/update.py's cached update) on 4 XLA CPU devices: every dot of the
    update is one of the Newton-Schulz iteration's three per step and group (X X^T, G G, P X),
    each device's covers at most ceil(n / 4) of a group's n matrices (read off the dots' batch
    dims in the optimized, partitioned HLO), and each group's iterated stack is all-gathered whole.
    Unsplit, every dot would carry all n (the batch dims 4, 4 and 6 of tiny's stacks)."""
    info, programs = muon_update
    (program,) = [p for p in programs if _dots(p)]  # the update: the one program with dots
    steps = info["ns_steps"]
    # what each group's iteration multiplies, as result shapes: X X^T and G G are [rows, rows],
    # P X is [rows, cols]; each may hold ceil(n / 4) matrices per device
    allowed: dict[tuple[int, int], list[int]] = {}
    for r, c, n in info["groups"]:
        share = -(-n // 4)
        assert share < n  # splitting must show
        allowed.setdefault((r, r), []).extend([share] * 2 * steps)
        allowed.setdefault((r, c), []).extend([share] * steps)
    got: dict[tuple[int, int], list[int]] = {}
    for b, r, c in _dots(program):
        got.setdefault((r, c), []).append(b)
    assert {k: len(v) for k, v in got.items()} == {k: len(v) for k, v in allowed.items()}, got
    for shape, batches in got.items():
        # shapes shared by groups (tiny's 128 x 128 Grams): some assignment of the dots to the
        # groups keeps every one within its group's share (sorted pairwise comparison)
        pairs = zip(sorted(batches), sorted(allowed[shape]), strict=True)
        assert all(b <= share for b, share in pairs), (shape, batches, allowed[shape])
    gathered = [arrays(c.shape) for c in program.collectives() if c.op == "all-gather"]
    for r, c, n in info["groups"]:
        padded = 4 * -(-n // 4)
        assert [("f32", padded * r * c)] in gathered, (r, c, n, gathered)


if __name__ == "__main__":  # print what a dump holds: python tests/test_xla_program.py DIR
    import sys

    for p in step_programs(Path(sys.argv[1])):
        print(p.path.name, json.dumps([c.__dict__ for c in p.collectives()])[:2000])
