"""Reading a compiled TPU program (the text libtpu's compiler returns, train/xla/tpu_compile.py):
its collectives by kind, size and place, and whether each runs asynchronously.

A collective's place is where the computation holding it is scheduled: the layer loop, the
micro-batch loop, or the step. What the TPU compiler writes (fused reduce-scatters, async
start/done pairs, continuation fusion) and how each is read: docs/tpu.md.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from codex.train.xla.hlo import (
    CALLED,
    COLLECTIVES,
    Program,
    array_texts,
    arrays,
    parse_text,
)

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=")
_COMPUTE = re.compile(r"\b(?:fusion|convolution|dot|custom-call)\(")


@dataclass
class TpuCollective:
    kind: str  # all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute
    bytes: int  # per chip: the collective's result (a reduce-scatter: the whole it reduces)
    place: str  # "layer loop", "micro-batch loop" or "step"
    is_async: bool  # a start/done pair in the schedule
    overlapped: int  # compute instructions scheduled between its start and done (0: sync)
    computation: str  # the computation holding it
    runs: int = 1  # times a step runs it: the trip counts of the loops around it multiplied
    # its arrays without layout, e.g. ["bf16[512,256]"] (a reduce-scatter: the wholes it reduces)
    shapes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TpuProgram:
    collectives: list[TpuCollective]
    kernels: list[str]  # the place of each Pallas kernel (tpu_custom_call), e.g. the flash kernels

    def collective_bytes(self) -> int:
        """Bytes a chip's collectives move in a step (each as often as its loops run it)."""
        return sum(c.bytes * c.runs for c in self.collectives)

    def where(self, kind: str | None = None, place: str | None = None) -> list[TpuCollective]:
        return [
            c
            for c in self.collectives
            if (kind is None or c.kind == kind) and (place is None or c.place == place)
        ]

    def summary_lines(self) -> list[str]:
        groups: dict[tuple, list[TpuCollective]] = {}
        for c in self.collectives:
            groups.setdefault((c.kind, c.place, c.is_async), []).append(c)
        out = []
        for (kind, place, is_async), cs in sorted(groups.items()):
            sizes = sorted({c.bytes for c in cs})
            size = _size(sizes[0]) + (f"-{_size(sizes[-1])}" if len(sizes) > 1 else "")
            overlap = min(c.overlapped for c in cs)
            how = (
                f"async, >= {overlap} compute op(s) between start and done" if is_async else "sync"
            )
            out.append(f"{kind:18} {place:16} x{len(cs):<4} {size:>19}  {how}")
        out = out or ["(none)"]
        if self.kernels:
            places = ", ".join(
                f"{self.kernels.count(p)} in the {p}" for p in sorted(set(self.kernels))
            )
            out.append(f"Pallas kernels (tpu_custom_call): {places}")
        return out


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def nbytes(shape: str) -> int:
    return sum(n * _BYTES.get(dtype, 4 if dtype[-2:] == "32" else 8) for dtype, n in arrays(shape))


def read_program(text: str, n_layer: int) -> TpuProgram:
    """The collectives of a TPU program's text; n_layer: the model's depth, the trip count that
    marks fsdp's layer loops (0 where the blocks are not scanned)."""
    program = parse_text(text)
    callers = _callers(program)
    loops = _loops(program, n_layer)  # body computation -> "layer loop" | "micro-batch loop"
    schedule = _schedule_index(program)
    out, kernels = [], []
    for name, lines in program.computations.items():
        kernels += [
            loops.get(_scheduled_in(name, callers, schedule)[0], "step")
            for line in lines
            if 'custom_call_target="tpu_custom_call"' in line
        ]
        if name.startswith("async_collective_fusion"):
            continue  # a started collective's continuation steps, fused into compute: not a new one
        if any('custom_call_target="AsyncCollectiveDone"' in line for line in lines):
            continue  # the done half of an async pair repeats its collective: counted at the start
        for line in lines:
            kind = _collective_kind(line, name)
            if kind is None:
                continue
            shape = line.split("=", 1)[1].strip()
            fused = kind == "reduce-scatter" and name.startswith("all-reduce-scatter")
            shape = shape[: shape.index(" " + ("all-reduce" if fused else kind))]
            if kind == "reduce-scatter" and not fused:
                shape = _scattered_whole(shape, line)
            scheduled, call = _scheduled_in(name, callers, schedule)
            place = loops.get(scheduled, "step")
            is_async, overlapped = _async(program, name, scheduled, call)
            runs = _runs(program, scheduled, callers, schedule)
            shapes = array_texts(shape)
            out.append(
                TpuCollective(kind, nbytes(shape), place, is_async, overlapped, name, runs, shapes)
            )
    return TpuProgram(out, kernels)


def _scattered_whole(shape: str, line: str) -> str:
    """A reduce-scatter instruction's result `shape` (each chip's shard) as the whole it reduces:
    its scattered dim times the group's size (the fused form's all-reduce shows the whole)."""
    (dim,) = re.findall(r"dimensions=\{(\d+)\}", line)
    listed = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]<=", line)
    size = len(listed[1].split(",")) if listed else int(iota[1]) if iota else 1
    wholes = []
    for text in array_texts(shape):
        dtype, dims = text[:-1].split("[")
        sizes = dims.split(",")
        sizes[int(dim)] = str(int(sizes[int(dim)]) * size)
        wholes.append(f"{dtype}[{','.join(sizes)}]")
    return "(" + ", ".join(wholes) + ")" if len(wholes) > 1 else wholes[0]


def _collective_kind(line: str, computation: str) -> str | None:
    for op in COLLECTIVES:
        if re.search(rf"\s{op}(?:-start)?\(", line) and _NAME.match(line):
            if op == "all-reduce" and computation.startswith("all-reduce-scatter"):
                return "reduce-scatter"
            return op
    return None


def _callers(program: Program) -> dict[str, list[tuple[str, str]]]:
    """computation -> [(calling computation, the calling instruction's line)]."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, lines in program.computations.items():
        for line in lines:
            for called in CALLED.findall(line):
                out.setdefault(called, []).append((name, line))
    return out


def _schedule_index(program: Program) -> set[str]:
    """The scheduled computations: the entry and every While's body."""
    bodies = {re.findall(r"body=%?([\w.\-]+)", w)[0] for w in program.whiles}
    return bodies | {program.entry}


def _scheduled_in(name: str, callers: dict, schedule: set[str]) -> tuple[str, str]:
    """(the scheduled computation that runs `name`, the instruction there that calls it)."""
    call = ""
    seen = set()
    while name not in schedule and name in callers and name not in seen:
        seen.add(name)
        name, call = callers[name][0]
    return name, call


def _loops(program: Program, n_layer: int) -> dict[str, str]:
    """Each While body -> its place: a While that holds no other While and runs n_layer times is
    a layer loop (n_layer 0: none is), any other the micro-batch loop."""
    bodies = {w: re.findall(r"body=%?([\w.\-]+)", w)[0] for w in program.whiles}
    out = {}
    for line, body in bodies.items():
        (condition,) = re.findall(r"condition=%?([\w.\-]+)", line)
        holds_loop = any(b != body and b in program.reachable(body) for b in bodies.values())
        trips = _trip_count(program.computations.get(condition, []))
        layer = n_layer > 0 and trips == n_layer and not holds_loop
        out[body] = "layer loop" if layer else "micro-batch loop"
    return out


def _runs(program: Program, scheduled: str, callers: dict, schedule: set[str]) -> int:
    """How often a step runs the scheduled computation `scheduled`: the trip counts of the Whiles
    around it multiplied (1 for the entry; an unknown trip count counts once)."""
    runs, seen = 1, set()
    while scheduled != program.entry and scheduled not in seen:
        seen.add(scheduled)
        line = next((w for w in program.whiles if f"body=%{scheduled}" in w), None)
        if line is None:
            break
        (condition,) = re.findall(r"condition=%?([\w.\-]+)", line)
        runs *= max(1, _trip_count(program.computations.get(condition, [])))
        holder = next(n for n, lines in program.computations.items() if line in lines)
        scheduled = _scheduled_in(holder, callers, schedule)[0]
    return runs


def _trip_count(condition: list[str]) -> int:
    """A counted loop's bound: the one non-zero constant its condition compares with (0 when the
    condition is not of that shape)."""
    constants = {int(m) for line in condition for m in re.findall(r"constant\((\d+)\)", line)}
    constants.discard(0)
    return constants.pop() if len(constants) == 1 else 0


def _async(program: Program, computation: str, scheduled: str, call: str) -> tuple[bool, int]:
    """(the collective is the start of an async pair, compute instructions scheduled between the
    start and its done)."""
    body = program.computations.get(computation, [])
    if not any('custom_call_target="AsyncCollectiveStart"' in line for line in body):
        return False, 0
    start = _NAME.match(call)
    if not start:
        return True, 0
    lines = program.computations[scheduled]
    names = [(_NAME.match(line) or [None, ""])[1] for line in lines]
    i = names.index(start[1])
    started = {start[1]}  # the start's value and what is taken from it (tuple elements)
    between = 0
    for name, line in zip(names[i + 1 :], lines[i + 1 :], strict=True):
        uses = set(re.findall(r"%([\w.\-]+)", line.split("=", 1)[1])) & started
        called = CALLED.findall(line)
        if uses and any(
            'custom_call_target="AsyncCollectiveDone"' in x
            for c in called
            for x in program.computations.get(c, [])
        ):
            return True, between
        if uses and re.search(r"\s(?:get-tuple-element|bitcast)\(", line):
            started.add(name)
        elif _COMPUTE.search(line) and not any(c.startswith("all-") for c in called):
            between += 1
    return True, between
