"""The default attention on a TPU preset holds no T x T scores: read in the optimized HLO of the
compiled training step, forward and backward (v6e-4's mesh on 4 XLA CPU devices, accumulation 2,
train.allow_cpu_xla; under fsdp too, the attention inside the scanned layer loop, in make
test-heavy), dumped with --xla_dump_to by the real training loop, as
tests/train/xla/test_xla_program.py does.

On the XLA CPU backend the Pallas kernel cannot run, so model.attention=auto runs blockwise
attention in XLA ops (model/attention.py: blockwise_causal); T = 512 with the default blocks of
128 (default_block), so the blocks are smaller than T. The same check on model.attention=sdpa
(XLA's math decomposition) finds the fp32 [.., T, T] probabilities: the check can fail. Both runs
train from the same init on the same batches, so their losses agree (the function is the same).

Run in the XLA venv:
    PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla tests/train/xla/test_xla_attention.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from codex.train.xla.hlo import Program, bytes_used, parse, step_programs
from tests.fixtures.procs import run_xla
from tests.fixtures.xla import PRELUDE, overrides, results

pytestmark = pytest.mark.xla

T = 512  # the tiny model's vocab (300) and widths stay below it: only attention reaches T x T
STEPS = 3
ACCUM = 2  # the cached step's While over the micro-batches, as every real step has

CHILD = """
c = cfg({run!r}, {ov!r})
emit("attention", c.model.attention)
emit("loss", train(c, evaluate)["loss"])
from codex.model.attention import default_block
emit("block", default_block(c.train.seq_len))
"""

# an array in HLO text with its dims: f32[2,4,512,512]{3,2,1,0}
_ARRAY_DIMS = re.compile(r"\b(f32)\[([\d,]+)\]")


def f32_shapes(program: Program) -> set[tuple[int, ...]]:
    """The shape of every f32 array any instruction of `program` produces or reads."""
    out = set()
    for lines in program.computations.values():
        for line in lines:
            for _, dims in _ARRAY_DIMS.findall(line):
                out.add(tuple(int(d) for d in dims.split(",")))
    return out


def square_buffers(shapes: set[tuple[int, ...]], seq_len: int) -> list[tuple[int, ...]]:
    """The shapes whose two trailing dimensions are both >= seq_len: [.., T, T] scores."""
    return sorted(s for s in shapes if len(s) >= 2 and min(s[-2:]) >= seq_len)


def largest(shapes: set[tuple[int, ...]], n: int = 4) -> list[tuple[int, ...]]:
    def size(s: tuple[int, ...]) -> int:
        k = 1
        for d in s:
            k *= d
        return k

    return sorted(shapes, key=size, reverse=True)[:n]


def _run(
    tmp: Path, name: str, attention: str | None, parallel: str = "auto"
) -> tuple[dict, set[tuple[int, ...]]]:
    """The child's results (plus the compiled steps' buffer totals, "step_bytes") and the shape
    of every f32 array in every program it compiled."""
    dump = tmp / f"dump-{name}"
    ov = overrides(
        "v6e-4", 1, STEPS, eval_every=0, seq_len=T, batch_tokens=T * 4 * ACCUM, log_every=STEPS
    ) + [f"model.max_seq_len={T}", f"train.parallel={parallel}"]
    if attention:
        ov.append(f"model.attention={attention}")
    proc = run_xla(
        PRELUDE + CHILD.format(run=str(tmp / f"run-{name}"), ov=ov),
        devices=4,
        env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text", "OMP_NUM_THREADS": "1"},
    )
    steps = step_programs(dump)
    assert steps, f"no compiled step (a program with a While) in {dump}"
    shapes: set[tuple[int, ...]] = set()
    for path in sorted(dump.glob("*after_optimizations.txt")):  # the step and every other
        shapes |= f32_shapes(parse(path))
    return {**results(proc), "step_bytes": max(bytes_used(p) for p in steps)}, shapes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attention")
    return {"default": _run(tmp, "default", None), "sdpa": _run(tmp, "sdpa", "sdpa")}


def test_default_attention_on_a_tpu_preset_holds_no_t_by_t_buffer(runs):
    info, shapes = runs["default"]
    assert info["attention"] == "auto" and info["block"] < T
    found = square_buffers(shapes, T)
    assert not found, f"f32 buffers [.., >=T, >=T] with the default attention: {found}"
    print("default attention, largest f32 buffers:", largest(shapes))


@pytest.mark.heavy
def test_default_attention_under_fsdp_holds_no_t_by_t_buffer(tmp_path):
    """fsdp: the blocks run in torch_xla's layer scan (forward and backward scans), blockwise
    attention inside them; still no [.., >=T, >=T] f32 buffer in any compiled program."""
    info, shapes = _run(tmp_path, "fsdp", None, parallel="fsdp")
    assert info["attention"] == "auto" and info["block"] < T
    found = square_buffers(shapes, T)
    assert not found, f"f32 buffers [.., >=T, >=T] with the default attention under fsdp: {found}"
    print("default attention under fsdp, largest f32 buffers:", largest(shapes))


def test_sdpa_holds_the_t_by_t_probabilities(runs):
    """The check above can fail: XLA's math SDPA keeps fp32 [.., T, T] in the same step."""
    _, shapes = runs["sdpa"]
    found = square_buffers(shapes, T)
    assert found and all(s[-2:] == (T, T) for s in found), found
    print("sdpa, largest f32 buffers:", largest(shapes))


def test_blockwise_trains_as_sdpa_does(runs):
    """The same init and batches: the losses after the steps agree (fp32; the step's gradients
    went through blockwise's own backward)."""
    default, sdpa = runs["default"][0]["loss"], runs["sdpa"][0]["loss"]
    assert abs(default - sdpa) < 1e-4 * abs(sdpa), (default, sdpa)


def test_the_step_needs_fewer_bytes_than_with_sdpa(runs):
    """XLA's memory report of the compiled step: without the probabilities (and the K/V SDPA
    repeats per GQA group) its buffers total less."""
    default, sdpa = runs["default"][0]["step_bytes"], runs["sdpa"][0]["step_bytes"]
    print("compiled step bytes: default", default, "sdpa", sdpa)
    assert default < sdpa
