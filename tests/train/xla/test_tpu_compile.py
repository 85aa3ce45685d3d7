"""`codex train --compile-only`: the real step compiled by libtpu's TPU compiler on this CPU
machine (train/compile_only.py), read where the claims live: the TPU program's collectives and
the compiler's per-chip memory.

The xla tests run in the XLA venv (torch_xla 2.9 + the tpu-aot extra):
    PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla tests/train/xla/test_tpu_compile.py
The others (the topology names, the program reader, the missing-extra line) run anywhere.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from codex.core.config import ConfigError
from codex.train.plan.presets import get_preset
from tests.fixtures import ROOT

# a 3-layer model whose every weight a 16-chip fsdp divides; accumulation 2, so the step holds
# the micro-batch While with the layer loops nested in it. Width 256: on v6e:2x2 each chip's
# quarter of every weight fills the TPU's tiles (libtpu keeps the all-reduce of a gradient whose
# quarter is a few KB whole, e.g. width 64's 16 x 64 ones: the size, not the layout, decides)
SETTINGS = [
    "model.n_layer=3",
    "model.n_embd=256",
    "data.tokenizer.vocab_size=512",
    "train.seq_len=128",  # the flash kernel's key blocks are 128 wide
    "train.device_batch=2",
]
FLAGS_OFF = (
    "--xla_tpu_enable_async_collective_fusion=false --xla_enable_async_all_gather=false "
    "--xla_enable_async_all_reduce=false"
)

CHILD = """
import json, sys
from codex.core.config import build_config
from codex.train.compile_only import compile_only
cfg = build_config(overrides={overrides!r}, model="tiny", run={run!r})
report = compile_only(cfg)
print("REPORT " + json.dumps(report.to_dict()), flush=True)
"""


# v6e:4x4: wide enough that each chip's shard of a weight fills the TPU's (8, 128) tiles (a
# narrower one is padded up to them, and the padding, not the sharding, sets the bytes)
WIDE = ["model.n_embd=128", "data.tokenizer.vocab_size=4096"]


def _compile(tmp: Path, hardware: str, parallel: str, optimizer: str, extra=()) -> dict:
    chips = get_preset(hardware).devices
    overrides = [
        *SETTINGS,
        *extra,
        f"train.hardware={hardware}",
        f"train.parallel={parallel}",
        f"train.optimizer={optimizer}",
        f"train.batch_tokens={2 * 128 * chips * 2}",
    ]
    script = CHILD.format(overrides=overrides, run=str(tmp / "run"))
    child_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS"):
        child_env.pop(key, None)  # compile_only sets up the slice's CPU devices itself
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=str(ROOT),
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stderr[-6000:]}"
    return json.loads(lines[0][len("REPORT ") :])


_REPORTS: dict[str, dict] = {}


def _report(factory, hardware: str, parallel: str, optimizer: str, extra=()) -> dict:
    name = "-".join([hardware, parallel, optimizer, *(x.split(".")[-1] for x in extra)])
    if name not in _REPORTS:
        _REPORTS[name] = _compile(factory.mktemp(name), hardware, parallel, optimizer, extra)
    return _REPORTS[name]


@pytest.fixture(scope="module", params=["adamw", "muon"])
def optimizer(request):
    return request.param


def _step(report: dict) -> dict:
    (step,) = [p for p in report["programs"] if p["name"] == "step"]
    return step


def _where(step: dict, kind: str, place: str | None = None) -> list[dict]:
    return [
        c
        for c in step["collectives"]
        if c["kind"] == kind and (place is None or c["place"] == place)
    ]


# --- on the XLA venv: the TPU compiler ---------------------------------------------------------


@pytest.mark.xla
@pytest.mark.slow
def test_replicate_reduces_every_gradient_once_after_the_loops(tmp_path_factory, optimizer):
    """v6e:2x2 replicate: the micro-batch While holds no reduction; after it, the gradients'
    all-reduces together carry each fp32 gradient element once (the weights' bytes, plus
    scalars), i.e. one gradient reduction per optimizer step."""
    report = _report(tmp_path_factory, "v6e-4", "replicate", optimizer)
    step = _step(report)
    for kind in ("all-reduce", "reduce-scatter"):
        inside = [c for c in _where(step, kind) if c["place"] != "step"]
        assert not inside, f"{kind} inside a loop: {inside}"
    weights = report["weight_bytes"]
    reduced = sum(c["bytes"] for c in _where(step, "all-reduce", "step"))
    assert weights * 0.9 <= reduced <= weights * 1.1 + 4096, (reduced, weights)
    assert report["fits"]


@pytest.mark.xla
@pytest.mark.slow
def test_fsdp_layer_loop_gathers_async_and_reduce_scatters(tmp_path_factory, optimizer):
    """v6e:2x2 fsdp under codex's libtpu flags: the layer loop all-gathers each layer's weights as
    async start/done pairs with compute scheduled between them, and its gradients leave the loop
    reduce-scattered (no whole gradient all-reduced there)."""
    step = _step(_report(tmp_path_factory, "v6e-4", "fsdp", optimizer))
    print("v6e:2x2", optimizer, _check_gathers_overlap(step))
    assert _where(step, "reduce-scatter", "layer loop") or _where(
        step, "reduce-scatter", "micro-batch loop"
    ), step["collectives"]


def _tiny_shapes(extra=()) -> tuple[list[str], str, int]:
    """(each 2-D block weight's shape, the head's, the width) of SETTINGS' model (with `extra`'s
    settings), as "[r,c]"."""
    from dataclasses import replace

    from codex.core.config import build_config
    from codex.model.gpt import build_model

    cfg = build_config(overrides=[*SETTINGS, *extra], model="tiny")
    model = build_model(replace(cfg.model, vocab_size=cfg.data.tokenizer.vocab_size), seed=0)
    text = lambda p: "[" + ",".join(map(str, p.shape)) + "]"  # noqa: E731
    blocks = [text(p) for p in model.blocks[0].parameters() if p.dim() == 2]
    return blocks, text(model.lm_head.weight), cfg.model.n_embd


def _dims(shape: str) -> str:
    return shape[shape.index("[") :]


def _transposed(shape: str) -> str:
    """ "[r,c]" -> "[c,r]"."""
    return "[" + ",".join(reversed(_dims(shape)[1:-1].split(","))) + "]"


def _elements(shape: str) -> int:
    return math.prod(int(d) for d in _dims(shape)[1:-1].split(",") if d)


def _check_reduce_scatters(step: dict, chips: int, extra=()) -> dict:
    """The gradient reductions of an fsdp step's TPU program (test below); returns the counts."""
    blocks, head, width = _tiny_shapes(extra)
    loops = [c for c in step["collectives"] if c["place"] != "step"]
    # each block matrix's whole (or its transpose: one sharded on dim 1 scatters that)
    either = lambda s: min(_dims(s), _transposed(s))  # noqa: E731
    scattered = Counter(
        either(a) for c in _where(step, "reduce-scatter", "layer loop") for a in c["shapes"]
    )
    assert not Counter(map(either, blocks)) - scattered, (blocks, scattered)
    # the head's: reduce-scatters in the micro-batch loop, the first of the whole (computed as
    # [width, vocab]), each later phase of a shard of it
    heads = {head, _transposed(head)}
    micro = [
        _dims(a) for c in _where(step, "reduce-scatter", "micro-batch loop") for a in c["shapes"]
    ]
    whole = max(micro, key=_elements)
    assert whole in heads and len([m for m in micro if m in heads]) == 1, micro
    matrices = [
        a for c in loops if c["kind"] == "all-reduce" for a in c["shapes"] if _dims(a).count(",")
    ]
    assert not matrices, matrices
    # the head's [vocab, width] reduced once; the table's, of the same shape, never
    reduced = [a for c in loops if "reduce" in c["kind"] for a in c["shapes"] if _dims(a) in heads]
    assert len(reduced) == 1, reduced
    local_tokens = 2 * 128  # train.device_batch x train.seq_len
    # per array (the compiler combines collectives into tuples), weights' shapes aside (the head's
    # [vocab, width] outgrows a small batch, and does not grow with it)
    weights = {*heads, *blocks, *map(_transposed, blocks)}
    batch = [_elements(a) for c in loops for a in c["shapes"] if _dims(a) not in weights]
    assert max(batch) < chips * local_tokens * width
    inside = [c for c in loops if c["place"] == "micro-batch loop"]
    moved = [sum(map(_elements, c["shapes"])) for c in inside if c["kind"] == "all-to-all"]
    assert moved and set(moved) == {local_tokens * width}, moved
    return {
        kind: len(_where(step, kind)) for kind in ("reduce-scatter", "all-reduce", "all-to-all")
    }


def _check_gathers_overlap(step: dict) -> dict:
    """fsdp's layer loop gathers the layers' weights as async start/done pairs, each with compute
    (fusions, matmuls, the flash kernels) scheduled between its start and its done, and those
    pairs carry most of the loop's gathered bytes; returns the counts."""
    gathers = _where(step, "all-gather", "layer loop")
    pairs = [c for c in gathers if c["is_async"]]
    assert pairs, f"no async all-gather in the layer loop: {gathers}"
    assert all(c["overlapped"] > 0 for c in pairs), pairs
    assert 2 * sum(c["bytes"] for c in pairs) > sum(c["bytes"] for c in gathers), gathers
    return {"async": len(pairs), "sync": len(gathers) - len(pairs)}


@pytest.mark.xla
@pytest.mark.slow
def test_fsdp_reduces_each_gradient_by_a_reduce_scatter(tmp_path_factory, optimizer):
    """v6e:2x2 fsdp, AdamW and Muon, in the TPU compiler's program: every block matrix's gradient
    is reduced by a reduce-scatter in the layer loop (each chip's own tokens' product
    reduce-scattered in bf16 and widened on the shard, train/xla/reduce_scatter.py) and the
    head's in the micro-batch loop. No all-reduce in a
    loop holds a matrix: those left are of the norm gains' 1-D gradients (MaxText does not shard
    norm scales over fsdp: it all-reduces them whole too) and scalars. The embedding's gradient
    is reduced by nothing (sharded on its width, its slice of every token's gradient comes by the
    lookup's all-to-all of one chip's tokens), and no collective in the micro-batch loop holds
    the global batch's tokens x width."""
    step = _step(_report(tmp_path_factory, "v6e-4", "fsdp", optimizer))
    print("v6e:2x2", optimizer, _check_reduce_scatters(step, 4))


# v6e:4x4's checks: each chip's sixteenth of a gradient as large as v6e:2x2's quarter at width 256
# (libtpu keeps a gradient's all-reduce whole where the shard is a few KB)
WIDE_16 = ["model.n_embd=512", "data.tokenizer.vocab_size=4096"]


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.heavy
def test_fsdp_on_16_chips_gathers_while_the_layer_computes(tmp_path_factory, optimizer):
    """v6e:4x4 (16 chips, 4 hosts as one mesh) fsdp, AdamW and Muon, width 512: the layer loop's
    weight gathers are async pairs with the layer's compute between start and done, carrying
    most of its gathered bytes."""
    report = _report(tmp_path_factory, "v6e-16", "fsdp", optimizer, WIDE_16)
    assert report["topology"] == "v6e:4x4"
    step = _step(report)
    print("v6e:4x4", optimizer, _check_gathers_overlap(step), step["compile_s"])


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("hardware", ["v6e-8", "v6e-16"])
def test_fsdp_on_8_and_16_chips_reduces_each_gradient_by_a_reduce_scatter(
    tmp_path_factory, optimizer, hardware
):
    """v6e:2x4 (8 chips, 2 hosts) and v6e:4x4 (16 chips, 4 hosts) fsdp, AdamW and Muon, width
    512: the 2x2 check above (each block matrix's and the head's gradient by a reduce-scatter, no
    matrix all-reduced in a loop, the embedding's by the lookup's all-to-all, nothing of the
    global batch's size)."""
    step = _step(_report(tmp_path_factory, hardware, "fsdp", optimizer, WIDE_16))
    chips = get_preset(hardware).devices
    print(hardware, optimizer, _check_reduce_scatters(step, chips, WIDE_16), step["compile_s"])


@pytest.mark.xla
@pytest.mark.slow
def test_flash_kernels_compiled_inside_the_layer_loop(tmp_path_factory):
    """model.attention=auto takes the TPU's path: torch_xla's Pallas flash kernels (forward and
    the two backward ones) are tpu_custom_calls the TPU compiler compiles inside fsdp's layer
    loops; replicate runs them in the micro-batch loop's per-device body."""
    fsdp = _step(_report(tmp_path_factory, "v6e-4", "fsdp", "adamw"))
    assert fsdp["kernels"].count("layer loop") >= 3, fsdp["kernels"]
    replicate = _step(_report(tmp_path_factory, "v6e-4", "replicate", "adamw"))
    assert len(replicate["kernels"]) >= 3, replicate["kernels"]


def _recompile(step: dict, topology: str, libtpu_args: str, tag: str) -> tuple[dict, str]:
    """The step's HLO compiled again by libtpu under LIBTPU_INIT_ARGS=`libtpu_args` (a copy of
    its proto, so the report's program text stays): tpu_compile's record and the program text."""
    work = Path(step["proto"]).parent / f"recompile-{tag}"
    work.mkdir(exist_ok=True)
    proto = work / Path(step["proto"]).name
    proto.write_bytes(Path(step["proto"]).read_bytes())
    request = work / "request.json"
    request.write_text(json.dumps({"topology": topology, "protos": [str(proto)]}))
    proc = subprocess.run(
        [sys.executable, "-m", "codex.train.xla.tpu_compile", str(request)],
        env={**os.environ, "LIBTPU_INIT_ARGS": libtpu_args, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("CODEX_TPU_PROGRAM ")]
    record = json.loads(line.split(" ", 1)[1])
    return record, Path(record["text"]).read_text()


@pytest.mark.xla
@pytest.mark.slow
def test_without_the_async_flags_no_gather_is_async(tmp_path_factory):
    """The same fsdp step compiled again with the async-collective flags off (a user's
    LIBTPU_INIT_ARGS wins over codex's): no all-gather is an async pair. libtpu 0.0.21 turns
    them on by itself for v6e; codex's flags keep them on whatever the default."""
    step = _step(_report(tmp_path_factory, "v6e-4", "fsdp", "adamw"))
    _, text = _recompile(step, "v6e:2x2", FLAGS_OFF, "async-off")
    from codex.train.xla.tpu_program import read_program

    program = read_program(text, 3)
    gathers = program.where("all-gather")
    assert gathers and not [c for c in gathers if c.is_async], program.summary_lines()


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize(
    ("group", "changes"),
    [("SCOPED_VMEM", "temp_bytes"), ("LAYOUT_FOR_REDUCE_SCATTER", "code_bytes")],
)
def test_each_v6e_flag_group_changes_the_program(tmp_path_factory, group, changes):
    """MaxText's v6e flag groups that codex sets (train/xla/platform.py: CHIP_FLAGS): the v6e:2x2
    fsdp step compiled with all of codex's v6e flags but that group is another program. The
    scoped VMEM limit changes the compiler's temporaries (and the HLO's fusions); the
    all-reduce-scatter layout changes the generated code (the HLO text stays the same)."""
    from codex.train.xla import platform

    step = _step(_report(tmp_path_factory, "v6e-4", "fsdp", "adamw"))
    assert all(f in platform.libtpu_flags("v6e") for f in getattr(platform, group))
    dropped = set(getattr(platform, group))
    without = " ".join(f for f in platform.libtpu_flags("v6e") if f not in dropped)
    record, _ = _recompile(step, "v6e:2x2", without, group)
    print(group, changes, "with", step[changes], "without", record[changes])
    assert record[changes] != step[changes], (group, changes, record[changes])


@pytest.mark.xla
@pytest.mark.slow
# Muon's 16-chip compile is a minute of make test's longest suite: make test-heavy runs it
@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("muon", marks=pytest.mark.heavy)])
def test_fsdp_on_16_chips_each_chip_holds_a_sixteenth(tmp_path_factory, optimizer):
    """v6e:4x4 (16 chips, 4 hosts as one global mesh) fsdp: each chip's arguments are about
    1/16 of the weights + optimizer state (within 10%): no chip holds a whole copy."""
    report = _report(tmp_path_factory, "v6e-16", "fsdp", optimizer, WIDE)
    assert report["topology"] == "v6e:4x4"
    share = report["state_bytes"] / 16
    arguments = _step(report)["argument_bytes"]
    assert share * 0.9 <= arguments <= share * 1.1, (arguments, share)
    assert report["fits"]


# --- anywhere ----------------------------------------------------------------------------------


def test_topology_names():
    from codex.train.compile_only import topology_name

    assert topology_name(get_preset("v6e-4")) == "v6e:2x2"
    assert topology_name(get_preset("v6e-16")) == "v6e:4x4"
    assert topology_name(get_preset("v6e-64")) == "v6e:8x8"
    assert topology_name(get_preset("v6e-128")) == "v6e:8x16"
    assert topology_name(get_preset("v6e-256")) == "v6e:16x16"
    assert topology_name(get_preset("v5litepod-8")) == "v5e:2x4"
    assert topology_name(get_preset("v5p-8")) == "v5p:2x2x1"
    assert topology_name(get_preset("v4-8")) == "v4:2x2x1"
    with pytest.raises(ConfigError, match="no TPU topology"):
        topology_name(get_preset("h100"))


PROGRAM = """HloModule m, is_scheduled=true

%all-reduce-scatter.1 (input: f32[64]) -> f32[16] {
  %input = f32[64]{0} parameter(0)
  %all-reduce.1 = f32[64]{0} all-reduce(%input), channel_id=1, to_apply=%add
  ROOT %ds = f32[16]{0} dynamic-slice(%all-reduce.1)
}

%start_comp (p: bf16[16]) -> (bf16[16], bf16[64]) {
  %p = bf16[16]{0} parameter(0)
  %all-gather.2 = bf16[64]{0} all-gather(%p), dimensions={0}
  ROOT %cc = (bf16[16]{0}, bf16[64]{0}) custom-call(%all-gather.2), \
custom_call_target="AsyncCollectiveStart"
}

%done_comp (p: (bf16[16], bf16[64])) -> bf16[64] {
  %p = (bf16[16]{0}, bf16[64]{0}) parameter(0)
  ROOT %cc = bf16[64]{0} custom-call(%p), custom_call_target="AsyncCollectiveDone"
}

%body (t: (u32[], bf16[16])) -> (u32[], bf16[16]) {
  %t = (u32[], bf16[16]{0}) parameter(0)
  %w = bf16[16]{0} get-tuple-element(%t), index=1
  %s = (bf16[16]{0}, bf16[64]{0}) fusion(%w), kind=kCustom, calls=%start_comp
  %c1 = f32[8]{0} fusion(%w), kind=kLoop, calls=%other
  %c2 = f32[8]{0} fusion(%c1), kind=kLoop, calls=%other
  %d = bf16[64]{0} fusion(%s), kind=kCustom, calls=%done_comp
  %rs = f32[16]{0} fusion(%c2), kind=kCustom, calls=%all-reduce-scatter.1
  ROOT %r = (u32[], bf16[16]{0}) tuple(%i, %w)
}

%cond (t: (u32[], bf16[16])) -> pred[] {
  %t = (u32[], bf16[16]{0}) parameter(0)
  %n = u32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (w: bf16[16]) -> bf16[16] {
  %w = bf16[16]{0} parameter(0)
  %loop = (u32[], bf16[16]{0}) while(%init), condition=%cond, body=%body
  %g = f32[32]{0} all-reduce(%x), channel_id=2, to_apply=%add
  ROOT %out = bf16[16]{0} get-tuple-element(%loop), index=1
}
"""


def test_program_reader_kinds_places_and_async_pairs():
    """The reader on a hand-written TPU program: an async all-gather (start/done fusions with two
    compute fusions between) and a fused reduce-scatter in a 3-trip While (the layer loop), and a
    sync all-reduce after it."""
    from codex.train.xla.tpu_program import read_program

    program = read_program(PROGRAM, n_layer=3)
    (gather,) = program.where("all-gather")
    assert (gather.place, gather.is_async, gather.overlapped, gather.bytes) == (
        "layer loop",
        True,
        2,
        128,
    )
    (scatter,) = program.where("reduce-scatter")
    assert (scatter.place, scatter.is_async, scatter.bytes) == ("layer loop", False, 256)
    (reduce,) = program.where("all-reduce")
    assert (reduce.place, reduce.is_async, reduce.bytes) == ("step", False, 128)
    # a model of another depth: the same While is not a layer loop
    assert read_program(PROGRAM, n_layer=4).where("all-gather")[0].place == "micro-batch loop"


def test_missing_extra_is_one_line(tmp_path):
    """Without JAX/libtpu (the main venv), --compile-only names the extra to install: one line,
    no traceback."""
    from codex.train.xla.tpu_compile import missing_packages

    if not missing_packages():
        pytest.skip("the tpu-aot extra is installed in this venv")
    proc = subprocess.run(
        [sys.executable, "-m", "codex.cli", "train", "--hardware", "v6e-4", "--compile-only"],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    error = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    assert len(error) == 1 and "codex[tpu-aot]" in error[0], proc.stderr
    assert "Traceback" not in proc.stderr
