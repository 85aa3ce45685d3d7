"""Reading XLA's optimized HLO dumps (`XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`): which
collectives a compiled program runs, and whether inside a While's body or after it.

A While's body is the computation named by `body=` on the `while(` line; everything it calls
(fusions, calls, nested Whiles) runs once per iteration, so it counts as inside.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# an instruction's called computations (fusions, calls, reductions, While bodies and conditions)
CALLED = re.compile(r"(?:calls|to_apply|body|condition|called_computations)=\{?%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY_TEXT = re.compile(r"\b(?:pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[[\d,]*\]")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]")


@dataclass
class Collective:
    op: str  # one of COLLECTIVES
    shape: str  # the result's shape text, e.g. "f32[64,64]{1,0}" or a tuple of them
    in_loop: bool  # inside a While's body (or something it calls)
    computation: str = ""  # the computation holding it

    @property
    def elements(self) -> int:
        return sum(n for _, n in arrays(self.shape))


@dataclass
class Program:
    path: Path | None
    computations: dict[str, list[str]]
    whiles: list[str]  # the `while(` instruction lines of every computation
    entry: str = ""  # the ENTRY computation's name

    def loop_computations(self) -> set[str]:
        """Every computation a While body runs, transitively."""
        return set().union(set(), *(self.reachable(_body(line)) for line in self.whiles))

    def collectives(self) -> list[Collective]:
        inside = self.loop_computations()
        out = []
        for name, lines in self.computations.items():
            for line in lines:
                for op in COLLECTIVES:
                    m = re.search(rf"=\s*(.+?)\s{op}(?:-start)?\(", line)
                    if m:
                        out.append(Collective(op, m.group(1), name in inside, name))
        return out

    def reachable(self, name: str) -> set[str]:
        """`name` and every computation it calls, transitively."""
        todo, seen = [name], set()
        while todo:
            n = todo.pop()
            if n in seen or n not in self.computations:
                continue
            seen.add(n)
            for line in self.computations[n]:
                todo += CALLED.findall(line)
                for group in _BRANCHES.findall(line):
                    todo += [b.strip().lstrip("%") for b in group.split(",")]
        return seen

    def loops(self) -> list[Loop]:
        """Every While, with the computations its body runs itself (nested Whiles' bodies
        excluded) and the Whiles nested in it."""
        out = []
        for line in self.whiles:
            runs = self.reachable(_body(line))
            inner = [w for w in self.whiles if w is not line and _body(w) in runs]
            nested = set().union(*(self.reachable(_body(w)) for w in inner)) if inner else set()
            out.append(Loop(line, runs - nested, inner))
        return out

    def while_carry(self) -> list[tuple[str, int]]:
        """(dtype, elements) of every array in the Whiles' loop-carried tuples."""
        return [a for line in self.whiles for a in arrays(line.split(" while(")[0])]

    def collectives_in(self, computations: set[str]) -> list[Collective]:
        return [c for c in self.collectives() if c.computation in computations]


@dataclass
class Loop:
    line: str  # the `while(` instruction
    computations: set[str]  # what its body runs, nested Whiles' bodies excluded
    nested: list[str]  # the `while(` lines of the Whiles inside it (at any depth)

    @property
    def body(self) -> str:
        """Its body computation's name."""
        return _body(self.line)

    def carry(self) -> list[tuple[str, int]]:
        """(dtype, elements) of every array of its loop-carried tuple."""
        return arrays(self.line.split(" while(")[0])

    def carry_shapes(self) -> list[str]:
        """Every array of its loop-carried tuple as text without layout, e.g. 'f32[3,16,64]'."""
        return array_texts(self.line.split(" while(")[0])


_NAMED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][\w\-]*)\(")
# ops that only move, lay out or cast a value
MOVES = ("transpose", "copy", "bitcast", "reshape", "convert")


def reduction_slices(program: Program) -> list[list[str]]:
    """Each all-reduce whose result reaches a dynamic-slice through ops of MOVES alone, each the
    only use of the one before (what a TPU's compiler may make one reduce-scatter): the opcodes
    between the two, e.g. ["transpose", "convert"]."""
    out = []
    for lines in program.computations.values():
        ops: dict[str, str] = {}
        users: dict[str, list[str]] = {}
        for line in lines:
            m = _NAMED.match(line)
            if not m:
                continue
            name, rest = m.groups()
            found = _OPCODE.search(" " + rest)
            ops[name] = found.group(1) if found else ""
            for used in set(re.findall(r"%([\w.\-]+)", rest)):
                users.setdefault(used, []).append(name)
        for name, opcode in ops.items():
            if opcode != "all-reduce":
                continue
            between, at = [], name
            while len(users.get(at, [])) == 1 and ops.get(users[at][0]) in MOVES:
                at = users[at][0]
                between.append(ops[at])
            if len(users.get(at, [])) == 1 and ops.get(users[at][0]) == "dynamic-slice":
                out.append(between)
    return out


def _body(while_line: str) -> str:
    return re.findall(r"body=%?([\w.\-]+)", while_line)[0]


def array_texts(shape: str) -> list[str]:
    """Every array in an HLO shape text, without its layout, e.g. ['f32[3,16,64]']."""
    return _ARRAY_TEXT.findall(shape)


def arrays(shape: str) -> list[tuple[str, int]]:
    """(dtype, elements) of every array in an HLO shape text."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append((dtype, n))
    return out


def parse(path: Path) -> Program:
    return parse_text(path.read_text(), path)


def parse_text(text: str, path: Path | None = None) -> Program:
    computations: dict[str, list[str]] = {}
    whiles = []
    current = None
    entry = ""
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s", line)
            current = m.group(1) if m else None
            if current:
                computations[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is not None:
            computations[current].append(line)
            if " while(" in line:
                whiles.append(line)
    return Program(path, computations, whiles, entry)


def step_programs(dump: Path) -> list[Program]:
    """The optimized programs in `dump` that hold a While (the training steps)."""
    programs = [parse(p) for p in sorted(dump.glob("*after_optimizations.txt"))]
    return [p for p in programs if p.whiles]


def partitioned(program: Program) -> Program:
    """`program` right after the SPMD partitioner (dumped with
    --xla_dump_hlo_pass_re=spmd-partitioning), before XLA's later passes (which on the CPU widen
    every bf16 value, collectives included, to f32)."""
    assert program.path is not None
    prefix = re.sub(r"\.\w+_after_optimizations\.txt$", ".", program.path.name)
    (path,) = program.path.parent.glob(prefix + "*after_spmd-partitioning*.txt")
    return parse(path)


def bytes_used(program: Program) -> int:
    """The compiled program's buffer total from its memory-usage report ("Total bytes used")."""
    report = Path(str(program.path).replace(".txt", "-memory-usage-report.txt"))
    m = re.search(r"Total bytes used: (\d+)", report.read_text())
    assert m, f"no total in {report}"
    return int(m.group(1))
