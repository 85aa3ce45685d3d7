"""The compiled XLA training step, read where the claims live: the optimized HLO that XLA runs on
4 XLA CPU devices (v6e-4's mesh), dumped with --xla_dump_to by the real training loop.

Parity of final parameters cannot see where a collective runs (a gradient all-reduce once per
micro-batch gives the same numbers as one per step), so these tests count collectives inside the
step's While (once per micro-batch), inside the fsdp layer loops nested in it (once per layer)
and after it (once per step), and read the carried buffers. Each layout runs 4 steps at
accumulation 2, with AdamW and with Muon, on a 3-layer model of width 64.

Run in the XLA venv:
    PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla tests/train/xla/test_xla_program.py
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest

from codex.train.xla.hlo import (
    Loop,
    Program,
    array_texts,
    arrays,
    bytes_used,
    parse,
    partitioned,
    reduction_slices,
    step_programs,
)
from tests.fixtures.procs import run_xla
from tests.fixtures.xla import PRELUDE, max_diff, model_at, overrides, results

pytestmark = pytest.mark.xla

ACCUM = 2
STEPS = 4
SEQ = 24  # local tokens (2 rows x 24) differ from every weight dim: shapes in the HLO tell apart
# a small model whose every block weight has a dim 4 devices divide (head dim 16)
MODEL = ["model.n_layer=3", "model.n_embd=64"]

CHILD = """
from dataclasses import replace
from codex.model.gpt import build_model, mlp_hidden
from tests.fixtures.runs import VOCAB
c = cfg({run!r}, {ov!r})
emit("loss", train(c, evaluate)["loss"])
m = build_model(replace(c.model, vocab_size=VOCAB, mlp_hidden=mlp_hidden(c.model)), seed=0)
emit("param_elements", sum(p.numel() for p in m.parameters()))
emit("param_shapes", [list(p.shape) for p in m.parameters()])
emit("param_names", [n for n, _ in m.named_parameters()])
emit("block_shapes", [list(p.shape) for p in m.blocks[0].parameters()])
from codex.train.xla.sharding import model_specs
specs = model_specs(m, 4)
emit("param_specs", list(specs.values()))
emit("block_specs", [specs["blocks.0." + n] for n, _ in m.blocks[0].named_parameters()])
emit("width", c.model.n_embd)
emit("n_layer", len(m.blocks))
from codex.train.plan.presets import get_preset
from codex.train.plan.batch import grad_accum_steps
from codex.train.plan.memory import Setting, plan
t = c.train
accum = grad_accum_steps(t.batch_tokens, t.device_batch, t.seq_len, 4)
emit("accum", accum)
mp = plan(replace(c.model, vocab_size=VOCAB), get_preset("v6e-4"), t.device_batch, t.seq_len,
          Setting(layout=t.parallel, dtype=t.dtype, optimizer=t.optimizer, world=4, accum=accum))
emit("plan", {{"total": mp.total, "gradients": mp.gradients,
               "compute_weights": mp.compute_weights}})
"""


def _run(tmp: Path, name: str, flags: str = "", **extra) -> tuple[dict, list[Program], str]:
    dump = tmp / f"dump-{name}"
    run = tmp / f"run-{name}"
    ov = overrides(
        "v6e-4",
        2,
        STEPS,
        eval_every=0,
        save_every=STEPS,
        seq_len=SEQ,
        batch_tokens=2 * SEQ * 4 * ACCUM,
        **extra,
    )
    proc = run_xla(
        PRELUDE + CHILD.format(run=str(run), ov=ov + MODEL),
        devices=4,
        env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text {flags}"},
    )
    programs = step_programs(dump)
    assert programs, f"no compiled program with a While in {dump}"
    info = results(proc)
    assert info["accum"] == ACCUM
    return info, programs, str(run)


# Muon's runs: `make test-heavy` (Muon on XLA is also trained in test_xla.py and read below)
@pytest.fixture(scope="module", params=["adamw", pytest.param("muon", marks=pytest.mark.heavy)])
def optimizer(request):
    return request.param


_RUNS: dict[str, tuple[dict, list[Program], str]] = {}


def _once(factory, layout: str, optimizer: str) -> tuple[dict, list[Program], str]:
    """The run of `layout` with `optimizer`, made on first use (the bf16 test reads fsdp-adamw
    too)."""
    name = f"{layout}-{optimizer}"
    if name not in _RUNS:
        _RUNS[name] = _run(factory.mktemp("hlo"), name, parallel=layout, optimizer=optimizer)
    return _RUNS[name]


@pytest.fixture(scope="module")
def replicate(tmp_path_factory, optimizer):
    return _once(tmp_path_factory, "replicate", optimizer)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, optimizer):
    return _once(tmp_path_factory, "fsdp", optimizer)


def test_replicate_reduces_once_after_the_while(replicate):
    """No gradient all-reduce inside the While; after it, every gradient element reduced exactly
    once per step (the buckets the combiner forms may differ; their sizes add up)."""
    info, programs, _ = replicate
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
    info, programs, _ = replicate
    for program in programs:
        carried = [n for dtype, n in program.while_carry() if dtype == "f32"]
        for shape in info["param_shapes"]:
            assert math.prod(shape) in carried, (shape, program.path.name)
        s64 = [n for dtype, n in program.while_carry() if dtype == "s64"]
        # [rows per device = 2, accum, T] token ids: one device's quarter of the 8 rows
        assert 2 * ACCUM * SEQ in s64 and 8 * ACCUM * SEQ not in s64, s64


def _shape(dims) -> str:
    return "f32[" + ",".join(str(d) for d in dims) + "]"


def _local(shape: list[int], spec: list) -> list[int]:
    """A weight's shape on one of the 4 devices (train/xla/sharding.py: model_specs)."""
    return [d // 4 if axis else d for d, axis in zip(shape, spec, strict=True)]


def _blocks(info: dict) -> list[tuple[list[int], list[int]]]:
    """(whole shape, one device's shape) of each block weight."""
    return [
        (s, _local(s, spec))
        for s, spec in zip(info["block_shapes"], info["block_specs"], strict=True)
    ]


def _fsdp_loops(program: Program) -> tuple[Loop, list[Loop], list[Loop]]:
    """(the micro-batch While, its forward layer loops, its backward layer loops): the layer
    loops are the Whiles nested in the micro-batch one; a backward one reduces gradients."""
    loops = program.loops()
    (outer,) = [loop for loop in loops if loop.nested]
    inner = [loop for loop in loops if loop.line in outer.nested]
    reducing = [
        loop
        for loop in inner
        if any(c.op in REDUCTIONS for c in program.collectives_in(loop.computations))
    ]
    forward = [loop for loop in inner if loop not in reducing]
    assert forward and reducing, (program.path.name, len(inner))
    return outer, forward, reducing


REDUCTIONS = ("all-reduce", "reduce-scatter")


def test_fsdp_gathers_one_layer_at_a_time_inside_the_layer_loop(fsdp):
    """ZeRO-3 (train/xla/layer_scan.py): the blocks run as a While over their stacked weights inside
    the micro-batch While. Each layer loop's body (forward, and backward again) all-gathers every
    block weight once, each one layer's weight in size; the loop carries the stacked weights
    sharded (a quarter of each, for all layers); outside the layer loops no block weight is
    gathered, whole or stacked (only the root: embedding, head, final norm)."""
    info, programs, _ = fsdp
    blocks, n_layer = info["block_shapes"], info["n_layer"]
    whole = sorted(math.prod(s) for s in blocks)
    for program in programs:
        outer, forward, backward = _fsdp_loops(program)
        for loop in forward + backward:
            gathers = [c for c in program.collectives_in(loop.computations) if c.op == "all-gather"]
            assert sorted(c.elements for c in gathers) == whole, (program.path.name, gathers)
            stacks = Counter(_shape([n_layer, *local]) for _, local in _blocks(info))
            assert not stacks - Counter(loop.carry_shapes()), (stacks, loop.line[:300])
        layer = set().union(*(loop.computations for loop in forward + backward))
        outside = [
            c for c in program.collectives() if c.op == "all-gather" and c.computation not in layer
        ]
        quarters = {tuple(local) for _, local in _blocks(info)}  # a whole may equal a quarter
        for shape in blocks:
            if len(shape) == 2 and tuple(shape) not in quarters:
                for dims in (shape, [n_layer, *shape]):
                    assert not [c for c in outside if c.shape.startswith(_shape(dims))], (
                        shape,
                        outside,
                    )


def test_fsdp_reduces_each_layer_gradient_to_a_quarter_inside_the_layer_loop(fsdp):
    """Each block gradient is reduced inside the backward layer loop, once per layer and
    micro-batch, to its weight's quarter. The CPU pipeline emits it as an all-reduce of the
    layer's whole gradient followed by the dynamic-slice of this device's quarter (the pattern a
    TPU pipeline turns into a reduce-scatter); read either way: a reduce-scatter of the quarter or
    an all-reduce of the whole, per block weight, and the loop carries the stacked gradient as
    quarters (each block weight's [layers, quarter] array twice: the stacked weight and its
    gradient)."""
    info, programs, _ = fsdp
    blocks, n_layer = info["block_shapes"], info["n_layer"]
    for program in programs:
        _, _, backward = _fsdp_loops(program)
        for loop in backward:
            reductions = [
                c for c in program.collectives_in(loop.computations) if c.op in REDUCTIONS
            ]
            expected = sorted(math.prod(s) for s in blocks)
            got = sorted(c.elements * (4 if c.op == "reduce-scatter" else 1) for c in reductions)
            assert got == expected, (program.path.name, reductions)
            # the stacked weights and the stacked gradient: the multiset of quarters, twice
            stacks = Counter(_shape([n_layer, *local]) for _, local in _blocks(info))
            assert not stacks + stacks - Counter(loop.carry_shapes()), loop.line[:300]


def test_fsdp_moves_nothing_of_the_global_batch_size_per_micro_batch(fsdp):
    """No collective inside the micro-batch While (its body and the layer loops in it) has
    global tokens x width elements or more, other than a weight's own gather or gradient: the
    embedding table is sharded on its width (train/xla/sharding.py: model_specs), so the lookup
    moves one device's tokens x width by an all-to-all, forward and backward. Sharded on the
    vocabulary, the partitioner all-reduced the whole slice's lookup, [global tokens, width], and
    gathered it again in the backward, every micro-batch."""
    info, programs, _ = fsdp
    width, local_tokens = info["width"], 2 * SEQ
    global_tokens = 4 * local_tokens
    weights = {tuple(sorted(s)) for s in info["param_shapes"]}

    def a_weight(c) -> bool:
        return all(tuple(sorted(_dims(a))) in weights for a in array_texts(c.shape))

    for program in programs:
        outer, _, _ = _fsdp_loops(program)
        inside = program.collectives_in(program.reachable(outer.body))
        big = [c for c in inside if c.elements >= global_tokens * width and not a_weight(c)]
        assert not big, (program.path.name, big)
        moved = [c.elements for c in inside if c.op == "all-to-all"]
        assert moved and set(moved) == {local_tokens * width}, (program.path.name, moved)


def _dims(array: str) -> list[int]:
    return [int(d) for d in array.split("[")[1].rstrip("]").split(",") if d]


def test_fsdp_carries_no_whole_gradient_and_fits_the_plan(fsdp):
    """No fp32 buffer of P or more elements is carried by any While. The micro-batch While
    carries every parameter's fp32 gradient accumulator as its quarter, a block weight's stacked
    over the layers as the weight is (train/xla/layer_scan.py: stack_blocks), and the stacked
    block weights as quarters, and less than P fp32 elements in all (with the root gathered whole
    and the RoPE tables; ZeRO-2 carried 2 P, replicate carries 2 P). The compiled program's
    buffers (XLA's memory report) stay within the plan's total."""
    info, programs, _ = fsdp
    P, plan, n_layer = info["param_elements"], info["plan"], info["n_layer"]
    assert plan["gradients"] == -(-4 * P // 4)
    root = zip(info["param_names"], info["param_shapes"], info["param_specs"], strict=True)
    expected = Counter(  # the root's accumulators
        _shape(_local(s, spec)) for name, s, spec in root if not name.startswith("blocks.")
    )
    for _ in range(2):  # the stacks and their accumulators
        expected.update(_shape([n_layer, *local]) for _, local in _blocks(info))
    for program in programs:
        for loop in program.loops():
            assert max(n for dtype, n in loop.carry() if dtype == "f32") < P, loop.line[:200]
        outer, _, _ = _fsdp_loops(program)
        f32 = sum(n for dtype, n in outer.carry() if dtype == "f32")
        assert f32 < P, (program.path.name, f32, P)
        carried = Counter(outer.carry_shapes())
        assert not expected - carried, (expected - carried, program.path.name)
        assert bytes_used(program) <= plan["total"], (program.path.name, plan)


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+\[[\d,]*\])\S*\s+([\w\-]+)\((.*)$")


def _stack_builders(program: Program, info: dict) -> list[str]:
    """What builds an f32 stack [n_layer, ...] of a block weight (whole or one device's quarter)
    in `program`: any concatenate of that shape, and any copy of that shape that a While takes
    in, other than of a broadcast (a zero accumulator). XLA's in-place optimizer update copies
    its moments (read and written in one program) outside any While; those are not weights."""
    n_layer = info["n_layer"]
    stacks = {_shape([n_layer, *dims]) for pair in _blocks(info) for dims in pair}
    out = []
    for lines in program.computations.values():
        defs = {m.group(1): m.groups()[1:] for line in lines if (m := _DEF.match(line))}
        for shape, op, args in defs.values():
            if op == "concatenate" and shape in stacks:
                out.append(f"{shape} concatenate({args[:80]}")
        for line in lines:
            loop = re.search(r"\swhile\(%([\w.\-]+)\)", line)
            if not loop or defs.get(loop.group(1), ("", ""))[1] != "tuple":
                continue
            for name in re.findall(r"%([\w.\-]+)", defs[loop.group(1)][2]):
                shape, op, args = defs.get(name, ("", "", ""))
                if op == "copy" and shape in stacks and not args.startswith("%broadcast"):
                    out.append(f"{shape} copy({args[:80]} into a While")
    return out


def test_fsdp_keeps_the_block_weights_stacked(fsdp):
    """The block weights, their gradient accumulators and their optimizer state are kept stacked
    [n_layer, ...] and sharded for the whole run (train/xla/layer_scan.py: stack_blocks): no
    concatenate in any compiled program builds an f32 stack of a block weight, and no copy of
    one enters a While (per-layer weights were stacked by a concatenate at every step; a
    stacked weight the update reads after the loop was copied into it, until the update read
    the loop's own output: train/xla/step.py, _read_through)."""
    info, programs, run = fsdp
    dump = sorted(Path(run).parent.glob("dump-*/*after_optimizations.txt"))
    assert dump and programs
    for program in [parse(p) for p in dump]:
        built = _stack_builders(program, info)
        assert not built, (program.path.name, built)
    # the check sees the loop's stacked weights themselves: each While of the step takes them in
    for program in programs:
        outer, _, _ = _fsdp_loops(program)
        assert set(_shape([info["n_layer"], *q]) for _, q in _blocks(info)) <= set(
            outer.carry_shapes()
        )


def test_fsdp_trains_as_replicate(fsdp, replicate):
    """The same weights after 4 steps (accumulation 2) under fsdp (ZeRO-3, scanned layers) as
    under replicate (per-device While, one all-reduce), within 1e-5, for AdamW and Muon."""
    diff = max_diff(model_at(fsdp[2], STEPS), model_at(replicate[2], STEPS))
    assert diff < 1e-5, diff
    assert abs(fsdp[0]["loss"] - replicate[0]["loss"]) < 1e-5


@pytest.fixture(scope="module")
def fsdp_bf16(tmp_path_factory):
    return _run(
        tmp_path_factory.mktemp("hlo"),
        "fsdp-bf16",
        "--xla_dump_hlo_pass_re=spmd-partitioning",
        parallel="fsdp",
        optimizer="adamw",
        dtype="bf16",
    )


@pytest.mark.heavy  # its own fsdp run, a minute on 2 cores
def test_fsdp_gathers_layers_in_bf16_under_bf16(fsdp_bf16, tmp_path_factory):
    """Under bf16 each layer's weights are cast on their shards and gathered in bf16 inside the
    layer loops (read right after the SPMD partitioner: the CPU pipeline then widens every bf16
    value, collectives included, to f32, which a TPU does not), the loops carry no whole weight
    in either dtype, each gradient is reduced in bf16 and widened only after its slice, and the
    run trains as the fp32 one does."""
    info, programs, _ = fsdp_bf16
    blocks, n_layer = info["block_shapes"], info["n_layer"]
    for program in programs:
        split = partitioned(program)
        _, forward, backward = _fsdp_loops(split)
        for loop in forward + backward:
            gathers = [c for c in split.collectives_in(loop.computations) if c.op == "all-gather"]
            assert sorted(arrays(c.shape)[0] for c in gathers) == sorted(
                ("bf16", math.prod(s)) for s in blocks
            ), (program.path.name, gathers)
            carried = set(loop.carry_shapes())
            quarters = {tuple(local) for _, local in _blocks(info)}  # a whole may equal a quarter
            for shape in blocks:
                if len(shape) == 2 and tuple(shape) not in quarters:
                    for dtype in ("f32", "bf16"):
                        text = _shape([n_layer, *shape]).replace("f32", dtype)
                        assert text not in carried, (shape, dtype, loop.line[:300])
    for program in programs:
        # each block matrix's gradient reduce-scattered in bf16 (written by hand, widened to fp32
        # on the shard after it), and any gradient's all-reduce left reaching its slice with no
        # convert between: a TPU's compiler makes such a pair one reduce-scatter
        split = partitioned(program)
        scattered = [c for c in split.collectives() if c.op == "reduce-scatter"]
        matrices = [s for s in blocks if len(s) == 2]
        assert len(scattered) >= len(matrices), (program.path.name, split.collectives())
        assert all(arrays(c.shape)[0][0] == "bf16" for c in scattered), scattered
        chains = reduction_slices(split)
        assert not [c for c in chains if "convert" in c], (program.path.name, chains)
    # the same data and init: bf16 autocast moves the loss by well under 2%
    fp32 = _once(tmp_path_factory, "fsdp", "adamw")[0]["loss"]
    assert abs(info["loss"] - fp32) < 0.02 * fp32


VALIDATION = """
from dataclasses import replace
from codex.model.gpt import mlp_hidden
from codex.train.launch import make_backend
from codex.train.plan.layout import Layout
from tests.fixtures.runs import VOCAB
c = build_config(overrides={ov!r}, model="tiny")
backend = make_backend(c)
m = backend.build_model(replace(c.model, vocab_size=VOCAB, mlp_hidden=mlp_hidden(c.model)), 0,
                        Layout("fsdp", shard=4))
g = torch.Generator().manual_seed(1)
batches = [tuple(torch.randint(0, VOCAB, (8, {seq}), generator=g) for _ in range(2))
           for _ in range(2)]
token_bytes = torch.ones(VOCAB, dtype=torch.int64)
emit("scanned", evaluate(m, batches, token_bytes, backend)["loss"])
from torch.nn.utils.stateless import _reparametrize_module
from codex.train.xla.layer_scan import layer_weights

def one_by_one(model, x, cos, sin, idx):  # the reference: each block on its layer's slices
    for i, block in enumerate(model.blocks):
        with _reparametrize_module(block, layer_weights(model, i)):
            x = block(x, cos, sin, model.value_embedding(i, idx))
    return x

m.blocks_runner = one_by_one
emit("unrolled", evaluate(m, batches, token_bytes, backend)["loss"])
emit("block_shapes", [list(p.shape[1:]) for p in m.stacked_blocks.parameters()])
emit("n_layer", len(m.blocks))
"""


def test_validation_under_fsdp_runs_the_layer_loop(tmp_path):
    """Validation under fsdp (eval/evaluate.py through the XLA backend's model) runs the blocks
    as the training step's forward layer loop does (train/xla/layer_scan.py: forward_only): its
    program holds a While whose body all-gathers every block weight once, one layer's worth, and
    no block weight is gathered outside it. The blocks run one by one on their layers' slices of
    the stacked weights (the reference) gather every layer's weights outside any loop, and give
    the same loss."""
    dump = tmp_path / "dump"
    ov = overrides("v6e-4", 2, 1, parallel="fsdp", seq_len=SEQ, allow_cpu_xla=True) + MODEL
    proc = run_xla(
        PRELUDE + VALIDATION.format(ov=ov, seq=SEQ),
        devices=4,
        env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text", "OMP_NUM_THREADS": "1"},
    )
    info = results(proc)
    assert abs(info["scanned"] - info["unrolled"]) < 1e-5, info
    whole = sorted(math.prod(s) for s in info["block_shapes"])
    matrices = [math.prod(s) for s in info["block_shapes"] if len(s) == 2]
    programs = [parse(p) for p in sorted(dump.glob("*after_optimizations.txt"))]
    looped = [p for p in programs if p.whiles]
    assert looped, "validation compiled no While"
    for program in looped:
        (loop,) = program.loops()
        gathers = [c for c in program.collectives_in(loop.computations) if c.op == "all-gather"]
        assert sorted(c.elements for c in gathers) == whole, (program.path.name, gathers)
        outside = [c for c in program.collectives() if c.op == "all-gather" and not c.in_loop]
        # the matrices (a norm's size may be the final norm's, gathered outside as the root)
        assert not [c for c in outside if c.elements in matrices], (program.path.name, outside)
    reference = [p for p in programs if not p.whiles]
    unrolled = [c.elements for p in reference for c in p.collectives() if c.op == "all-gather"]
    # the reference gathers every layer's weights outside any loop (a layer's or a whole stack
    # at a time): the check can see them
    assert reference and sum(unrolled) >= len(reference) * info["n_layer"] * sum(whole), unrolled


def test_replicate_program_within_the_memory_plan(replicate):
    info, programs, _ = replicate
    for program in programs:
        assert bytes_used(program) <= info["plan"]["total"], (program.path.name, info["plan"])


MUON_UPDATE = """
import sys
from collections import Counter
from codex.train.plan.world import set_xla_import_env
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
emit("layout", {layout!r})
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
        # replicated weights need every update whole: the iterated stack is gathered whole
        # (test_muon_under_fsdp_gathers_no_stack: fsdp's is not)
        assert ([("f32", padded * r * c)] in gathered) == (info["layout"] == "replicate"), (
            r,
            c,
            n,
            gathered,
        )


_STACK = re.compile(r"\w+\[(\d+),(\d+),(\d+)\]")


def _whole_stack_gathers(program: Program, groups: list[list[int]]) -> list:
    """The all-gathers in `program` whose output is a stack [k, rows, cols] of one shape group's
    matrices with more of them than a device iterates (k > ceil(n / 4) of the group's n)."""
    out = []
    for c in program.collectives():
        if c.op != "all-gather":
            continue
        for k, r, cols in (tuple(map(int, m)) for m in _STACK.findall(c.shape)):
            out += [(c.shape, g) for g in groups if (r, cols) == tuple(g[:2]) and k > -(-g[2] // 4)]
    return out


def test_muon_under_fsdp_gathers_no_stack(muon_update):
    """Under fsdp each chip needs only its weights' rows of every update: the iterated stacks go
    to row shards (an all-to-all), never gathered whole (replicate's all-gather of each group's
    [n, rows, cols]), so a chip holds ~1 / 4 of the updates (what train/plan/memory.py's
    muon_step_bytes counts). The weights still train as replicate's
    (test_fsdp_trains_as_replicate, Muon)."""
    info, programs = muon_update
    (program,) = [p for p in programs if _dots(p)]
    whole = _whole_stack_gathers(program, info["groups"])
    if info["layout"] == "replicate":
        assert whole, "replicate gathers every group's stack"  # the check can see one
        return
    assert not whole, whole
    moved = sum(c.elements for c in program.collectives() if c.op == "all-to-all")
    assert moved >= sum(r * c * n for r, c, n in info["groups"]) // 4, moved


def test_muon_under_fsdp_trains_without_gathering_a_stack(fsdp, optimizer):
    """The training run's compiled programs (fsdp, Muon, 3 layers): no all-gather holds more of
    a shape group's matrices than one device iterates."""
    if optimizer != "muon":
        pytest.skip("Muon's stacks")
    info, programs, run = fsdp
    shapes = Counter(tuple(sorted(s)) for s in info["block_shapes"] if len(s) == 2)  # wide
    groups = [[r, c, n * info["n_layer"]] for (r, c), n in shapes.items()]
    programs = [parse(p) for p in sorted(Path(run).parent.glob("dump-*/*after_optimizations.txt"))]
    assert programs
    for program in programs:
        assert not _whole_stack_gathers(program, groups), program.path.name


# print what a dump holds: python tests/train/xla/test_xla_program.py DIR
if __name__ == "__main__":
    import sys

    for p in step_programs(Path(sys.argv[1])):
        print(p.path.name, json.dumps([c.__dict__ for c in p.collectives()])[:2000])
