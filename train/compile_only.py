"""`codex train --compile-only`: the TPU step compiled by the TPU compiler, on any machine.

The run's programs (the step, validation's forward) are traced by the code a TPU run uses, on as
many XLA CPU devices as the slice has chips, and lowered to HLO, never run. libtpu's compile-only
client compiles them for the slice (train/xla/tpu_compile.py). The report, per chip: HBM beside
the plan, collectives (train/xla/tpu_program.py), cost, modelled step time and MFU; exit 1 when
the step does not fit. The trace holds real weights in host RAM, so a model that does not fit
here is refused first. The three steps and what they showed: docs/tpu.md.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from codex.core.config import Config, ConfigError, from_dict, to_dict
from codex.core.progress import setup_logging
from codex.model.gpt import flops_per_token
from codex.train.distributed.backend import BackendError, unwrap
from codex.train.optim.optimizer import make_optimizer
from codex.train.optim.schedule import lr_for, set_lr
from codex.train.plan.plan import Plan, make_plan, planned_vocab, tokenizer_vocab
from codex.train.plan.presets import CHIP_LINKS, HardwarePreset, get_preset
from codex.train.remat import apply_remat
from codex.train.xla.flash import lower_pallas_for_tpu, xla_attention
from codex.train.xla.platform import libtpu_init_args
from codex.train.xla.tpu_compile import EXTRA, missing_packages
from codex.train.xla.tpu_program import TpuProgram, read_program
from codex.train.xla.update import buffer_alias, state_tensors

log = logging.getLogger("codex.train")

# libtpu's topology names (JAX's get_topology_desc) of each TPU family's slices, by chip count:
# v4 and v5p name a 3-D torus (chips x x y x z), v5e and v6e a 2-D one.
_SHAPES_2D = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}


def topology_name(preset: HardwarePreset) -> str:
    """libtpu's name for the preset's slice, e.g. v6e-16 -> "v6e:4x4"."""
    shapes = _SHAPES_3D if preset.family in ("v4", "v5p") else _SHAPES_2D
    if preset.family not in CHIP_LINKS or preset.devices not in shapes:
        raise ConfigError(
            f"--compile-only compiles for a TPU slice, and hardware preset '{preset.name}' "
            f"({preset.kind}, {preset.devices} devices) has no TPU topology; "
            "pick a TPU preset (`codex hardware`)"
        )
    return f"{preset.family}:{shapes[preset.devices]}"


@dataclass
class CompiledProgram:
    name: str  # "step" (forward + backward + optimizer update) or "validation"
    compiled: dict  # train/xla/tpu_compile.py's record: memory, cost, compile seconds
    program: TpuProgram  # the TPU program's collectives

    donated: int = 0  # per chip: outputs that replace an argument in a run (weights, state)

    @property
    def new_output_bytes(self) -> int:
        """Outputs that need memory of their own. The lowered module aliases nothing; a run's
        sync donates the weights' and the optimizer state's buffers to their updates."""
        c = self.compiled
        return max(0, c["output_bytes"] - c["alias_bytes"] - self.donated)

    @property
    def hbm_bytes(self) -> int:
        """Per chip: arguments + outputs of their own + temporaries + generated code."""
        c = self.compiled
        return c["argument_bytes"] + self.new_output_bytes + c["temp_bytes"] + c["code_bytes"]


@dataclass
class CompileReport:
    preset: HardwarePreset
    topology: str
    plan: Plan
    step_tokens: int  # tokens per optimizer step
    flops_per_token: float  # the model's training FLOPs per token (MFU's numerator)
    libtpu_args: str
    state_bytes: int = 0  # the whole slice's weights and optimizer state (each chip: its share)
    weight_bytes: int = 0  # of which the weights
    work_dir: str = ""  # the HLO modules and TPU programs (the caller removes it)
    trace_s: float = 0.0  # the trace's wall time (its process: start-up, model, step, lowering)
    peak_host_bytes: int = 0  # the trace process's peak resident memory
    programs: list[CompiledProgram] = field(default_factory=list)

    @property
    def step(self) -> CompiledProgram:
        return self.programs[0]

    @property
    def fits(self) -> bool:
        return all(p.hbm_bytes <= self.preset.memory_gb * 1e9 for p in self.programs)

    def modelled_step_s(self) -> dict[str, float]:
        """The step's time on the slice, modelled, each term on its own (the step takes the
        slowest: a lower bound where they overlap): compute, the model's training FLOPs per chip
        at the chip's bf16 peak; HBM, the compiler's bytes accessed at the chip's bandwidth;
        ICI, the bytes of the step's collectives (each as often as its loops run it) at the
        chip's ICI bandwidth. libtpu's cost analysis counts a While's body once, so its FLOPs
        are not used and its bytes are a lower bound wherever the step loops."""
        flops = self.flops_per_token * self.step_tokens / self.preset.devices
        return {
            "compute": flops / self.preset.peak_flops,
            "hbm": self.step.compiled["bytes_accessed"] / self.preset.hbm_bandwidth,
            # a chip receives at most half its bidirectional ICI bandwidth
            "ici": self.step.program.collective_bytes() / (self.preset.ici_bandwidth / 2),
        }

    def modelled_mfu(self) -> float:
        """MaxText's convention: the model's training FLOPs per step (6 N + causal attention, per
        token: model/gpt.py's flops_per_token) over the slice's peak times the modelled step time
        (the slowest of the three terms)."""
        seconds = max(self.modelled_step_s().values())
        peak = self.preset.peak_flops * self.preset.devices
        return self.flops_per_token * self.step_tokens / (peak * seconds) if seconds else 0.0

    def lines(self) -> list[str]:
        gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
        p, chip = self.plan, self.preset.memory_gb * 1e9
        out = [
            f"compiled for {self.preset.name} ({self.topology}, {self.preset.devices} chips, "
            f"{self.preset.hosts} host(s)) by libtpu's TPU compiler",
            f"batch: {p.device_batch} x {p.seq_len} per chip, accum {p.accum}, "
            f"{self.step_tokens:,} tokens a step, {p.layout.describe()}",
        ]
        for prog in self.programs:
            c = prog.compiled
            out.append(
                f"{prog.name}: HBM per chip {gb(prog.hbm_bytes)} of {gb(chip)} "
                f"(arguments {gb(c['argument_bytes'])}, temporaries {gb(c['temp_bytes'])}, "
                f"outputs {gb(prog.new_output_bytes)} beside the donated, "
                f"code {gb(c['code_bytes'])}); compiled in {c['compile_s']:.1f} s"
            )
        out.append(f"the plan's figure for the step: {gb(p.memory.total)} per chip")
        out.append(
            f"traced on {self.preset.devices} XLA CPU devices in {self.trace_s:.0f} s, "
            f"{gb(self.peak_host_bytes)} of host memory at the peak"
        )
        out += ["step collectives (kind, place, count, bytes per chip each, async):"]
        out += ["  " + line for line in self.step.program.summary_lines()]
        t = self.modelled_step_s()
        c = self.step.compiled
        out.append(
            f"step cost (libtpu, each loop body once): {c['flops'] / 1e12:.3f} TFLOP and "
            f"{gb(c['bytes_accessed'])} of HBM traffic per chip; "
            f"modelled {max(t.values()) * 1e3:.1f} ms a step "
            f"(compute {t['compute'] * 1e3:.1f}, HBM {t['hbm'] * 1e3:.1f}, "
            f"ICI {t['ici'] * 1e3:.1f} ms), MFU {self.modelled_mfu():.1%}"
        )
        if not self.fits:
            worst = max(self.programs, key=lambda q: q.hbm_bytes)
            out.append(
                f"does not fit: the {worst.name} program needs {gb(worst.hbm_bytes)} per chip, "
                f"{gb(worst.hbm_bytes - chip)} more than a {self.preset.device_name} chip's "
                f"{gb(chip)}"
            )
        return out

    def to_dict(self) -> dict:
        return {
            "hardware": self.preset.name,
            "topology": self.topology,
            "device_batch": self.plan.device_batch,
            "seq_len": self.plan.seq_len,
            "accum": self.plan.accum,
            "layout": self.plan.layout.describe(),
            "planned_bytes": self.plan.memory.total,
            "state_bytes": self.state_bytes,
            "weight_bytes": self.weight_bytes,
            "trace_s": self.trace_s,
            "peak_host_bytes": self.peak_host_bytes,
            "libtpu_args": self.libtpu_args,
            "fits": self.fits,
            "modelled_step_s": self.modelled_step_s(),
            "modelled_mfu": self.modelled_mfu(),
            "programs": [
                {
                    "name": p.name,
                    "hbm_bytes": p.hbm_bytes,
                    **p.compiled,
                    "collectives": [c.to_dict() for c in p.program.collectives],
                    "kernels": p.program.kernels,
                }
                for p in self.programs
            ],
        }


# --- the three phases -------------------------------------------------------------------------


def compile_only(cfg: Config, libtpu_flags: bool = True) -> CompileReport:
    """Trace, compile and report (module doc), each phase in its own interpreter: the trace's
    runtime needs the slice's CPU devices set before torch_xla starts, and its memory is given
    back before the compiler runs. libtpu_flags=False compiles without codex's LIBTPU_INIT_ARGS
    (the user's own still apply), to see what the flags change."""
    preset = get_preset(cfg.train.hardware)
    topology = topology_name(preset)
    missing = missing_packages()
    if missing:
        raise BackendError(
            f"--compile-only needs JAX and libtpu for the TPU compiler, and {', '.join(missing)} "
            f"is not installed. Fix: pip install 'codex[{EXTRA}]' (in a checkout: "
            f"pip install -e '.[{EXTRA}]')"
        )
    # the run's tokenizer's vocab where it has one (as training would), else the planned one
    found = tokenizer_vocab(cfg)
    vocab = found if found is not None else planned_vocab(cfg)
    resolved, plan, _ = make_plan(cfg, preset, preset.devices, vocab=vocab)
    _check_host_memory(resolved, plan, preset)
    work = Path(tempfile.mkdtemp(prefix="codex-compile-"))
    log.info(
        "compile-only: tracing the step for %s on %d XLA CPU devices (%s)",
        preset.name,
        preset.devices,
        work,
    )
    start = time.perf_counter()
    trace = _trace_in_child(resolved, preset, work)
    trace["trace_s"] = time.perf_counter() - start
    log.info(
        "compile-only: traced in %.0f s; compiling the step and validation for %s with libtpu "
        "(minutes for a large model)",
        trace["trace_s"],
        topology,
    )
    user = os.environ.get("LIBTPU_INIT_ARGS", "")
    args = libtpu_init_args(user, preset.family) if libtpu_flags else user
    compiled = _compile(topology, [path for _, path in trace["programs"]], args, work)
    report = CompileReport(
        preset=preset,
        topology=topology,
        plan=plan,
        step_tokens=plan.batch_tokens,
        flops_per_token=flops_per_token(resolved.model, plan.seq_len),
        libtpu_args=args,
        state_bytes=trace["state_bytes"],
        weight_bytes=trace["weight_bytes"],
        work_dir=str(work),
        trace_s=trace["trace_s"],
        peak_host_bytes=trace["peak_host_bytes"],
    )
    scanned = resolved.model.n_layer if plan.layout.sharded and plan.layout.shard > 1 else 0
    for (name, _), record in zip(trace["programs"], compiled, strict=True):
        program = read_program(Path(record["text"]).read_text(), scanned)
        donated = trace["donated"] if name == "step" else 0
        report.programs.append(CompiledProgram(name, record, program, donated))
    return report


def _trace_in_child(cfg: Config, preset: HardwarePreset, work: Path) -> dict:
    """`python -m codex.train.compile_only WORK` on preset.devices XLA CPU devices: trace.json."""
    (work / "config.json").write_text(json.dumps(to_dict(cfg)))
    env = {
        **os.environ,
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(preset.devices),
        # JAX (the flash kernel's tracer) on its CPU backend: libtpu must not load beside
        # torch_xla's runtime (both hold an XLA; the process crashes)
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "codex.train.compile_only", str(work)],
        env=env,
        capture_output=True,
        text=True,
    )
    result = work / "trace.json"
    if proc.returncode != 0 or not result.exists():
        raise BackendError(f"tracing the step for {preset.name} failed: {_why(proc)}")
    return json.loads(result.read_text())


# the line of a child's stderr that says why it failed: a Python exception, a failed XLA check,
# a fatal signal
_FAILURE = r"^(?:[\w.]+(?:Error|Exception): |F\d{4} .*Check failed|\*\*\* SIG)"


def _why(proc: subprocess.CompletedProcess) -> str:
    lines = [x for x in proc.stderr.splitlines() if re.match(_FAILURE, x)]
    return (lines or [f"exit status {proc.returncode}"])[-1]


def trace(work: Path) -> None:
    """The child's side: build the step and validation as a TPU run builds them on this process's
    XLA CPU devices, lower each to an HLO module without compiling or running it, and write
    work/trace.json."""
    setup_logging()
    cfg, attention = _trace_config(work)
    preset = get_preset(cfg.train.hardware)
    from codex.train.xla.backend import make_xla_backend  # imports torch_xla

    # Never closed cleanly: a clean close runs what is pending, and the step must not run here.
    backend = make_xla_backend(cfg, preset)
    try:
        if attention == "flash":
            lower_pallas_for_tpu()
            backend.flash_attention, backend.flash_chip = True, preset.family
        resolved, plan, _ = make_plan(cfg, preset, backend.world_size, vocab=cfg.model.vocab_size)
        tcfg = resolved.train  # train.remat=auto resolved by the plan
        model = backend.build_model(cfg.model, tcfg.seed, plan.layout)
        model = apply_remat(model, tcfg.remat, backend.kind)
        raw = unwrap(model)
        optimizer = make_optimizer(raw, tcfg, backend.kind, backend.autocast_dtype)
        accumulate = backend.device_accumulation(model, plan.accum)
        update = backend.cached_update(raw, optimizer, tcfg.grad_clip)
        if accumulate is None or update is None:
            raise ConfigError("--compile-only compiles train.xla_step=cached's step")
        rows = plan.device_batch * backend.devices_per_loader
        batch = torch.zeros(rows, plan.seq_len, dtype=torch.int64)

        # the step: every micro-batch in one While, then clip + the optimizer's update
        loss = accumulate(itertools.repeat((batch, batch)))
        # the weights' device buffers, for validation once the step has made the weights its
        # pending outputs (taken after the While's trace, which maps the buffers it reads to the
        # parameters; a run validates on weights the step computed, here nothing runs)
        weights = {name: buffer_alias(p) for name, p in raw.named_parameters()}
        grad_norm = update(set_lr(optimizer, lr_for(0, tcfg, plan.total_steps)))
        optimizer.zero_grad(set_to_none=True)
        updated = [*raw.parameters(), *state_tensors(optimizer)]
        step = _lowered([loss, grad_norm, *updated], work / "step.hlo_module.pb")

        # validation: per-token losses of one device batch, as eval/evaluate.py computes them
        with torch.no_grad(), backend.autocast():
            x, y = backend.to_device((batch, batch))
            kwargs = {"targets": y, "reduction": "none"}
            losses = torch.func.functional_call(raw, weights, (x,), kwargs, tie_weights=False)
        validation = _lowered([losses.sum()], work / "validation.hlo_module.pb")
        result = {
            "programs": [("step", step), ("validation", validation)],
            "donated": sum(_per_chip_bytes(t) for t in updated),
            "state_bytes": sum(t.numel() * t.element_size() for t in updated),
            "weight_bytes": sum(p.numel() * p.element_size() for p in raw.parameters()),
            "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        (work / "trace.json").write_text(json.dumps(result))
    finally:
        backend.close(ok=False)


def _trace_config(work: Path) -> tuple[Config, str]:
    """The run's config as the trace runs it on XLA:CPU, and the attention a TPU would run."""
    cfg = from_dict(json.loads((work / "config.json").read_text()))
    cfg = replace(
        cfg,
        train=replace(
            cfg.train,
            allow_cpu_xla=True,
            xla_mode="spmd",
            xla_step="cached",
            xla_cache=str(work / "cache"),  # the backend starts a cache: not in the run folder
        ),
    )
    # the TPU's attention (flash where JAX is installed): the backend on XLA:CPU would run
    # blockwise, and refuses model.attention=flash off a TPU
    attention = xla_attention(cfg.model.attention, "TPU")
    if cfg.model.attention == "flash":
        cfg = replace(cfg, model=replace(cfg.model, attention="auto"))
    return cfg, attention


def _lowered(tensors: list[torch.Tensor], path: Path) -> str:
    """The program computing `tensors` as XLA would be handed it at the step's sync, lowered
    with its SPMD shardings and never compiled for XLA:CPU (which cannot compile the flash
    kernel's TPU custom call): a serialized HloModuleProto at `path`."""
    import torch_xla

    path.write_bytes(torch_xla._XLAC._get_xla_tensors_hlo_proto(tensors))
    return str(path)


def _compile(topology: str, protos: list[str], libtpu_args: str, work: Path) -> list[dict]:
    """train/xla/tpu_compile.py in its own interpreter: one record per proto."""
    request = work / "request.json"
    request.write_text(json.dumps({"topology": topology, "protos": protos}))
    env = {**os.environ, "LIBTPU_INIT_ARGS": libtpu_args}
    for key in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS"):
        env.pop(key, None)  # those were the trace's; libtpu reads its own flags
    proc = subprocess.run(
        [sys.executable, "-m", "codex.train.xla.tpu_compile", str(request)],
        env=env,
        capture_output=True,
        text=True,
    )
    records = [
        json.loads(line.split(" ", 1)[1])
        for line in proc.stdout.splitlines()
        if line.startswith("CODEX_TPU_PROGRAM ")
    ]
    if proc.returncode != 0 or len(records) != len(protos):
        raise BackendError(f"the TPU compiler failed for {topology}: {_why(proc)}")
    return records


def _per_chip_bytes(t: torch.Tensor) -> int:
    """The bytes of `t` one chip holds, from its sharding ("{devices=[4,1]0,1,2,3}": a quarter;
    "last_tile_dim_replicate": the last tile dim copies, not splits)."""
    from codex.train.xla.sharding import sharding_of

    spec = sharding_of(t)
    tiles = (
        [int(n) for n in re.findall(r"devices=\[([\d,]+)\]", spec)[0].split(",")]
        if ("devices=[" in spec)
        else [1]
    )
    if "last_tile_dim_replicate" in spec:
        tiles = tiles[:-1]
    return t.numel() * t.element_size() // math.prod(tiles)


def _check_host_memory(cfg: Config, plan: Plan, preset: HardwarePreset) -> None:
    """The trace keeps the fp32 weights and the optimizer's state on the XLA CPU devices, i.e.
    in this machine's memory, once in all when sharded and once per device when replicated, with
    the host copy the weights are built in: refuse a model that cannot fit here."""
    from codex.train.plan.params import optimizer_bytes, param_count

    params = param_count(cfg.model)
    state = 4 * params + optimizer_bytes(cfg.model, cfg.train.optimizer)
    copies = 1 if plan.layout.sharded else preset.devices
    # 2.2: what else the trace holds, from the peaks measured: 7b's width at 2 layers fsdp over 8
    # devices (8.5 GB of state, 21.4 GB at the peak); 124m replicated on 4 (11.3 GB) is below it
    need = int(state * copies * 2.2) + 4 * params
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > available:
        raise BackendError(
            f"--compile-only traces the step with the model's real weights and optimizer state "
            f"in this machine's memory ({plan.layout.describe()} on {preset.devices} devices): "
            f"about {need / 1e9:.0f} GB for {params / 1e9:.2f}B parameters, and "
            f"{available / 1e9:.0f} GB is free here; run it on a machine with more memory"
        )


if __name__ == "__main__":
    trace(Path(sys.argv[1]))
