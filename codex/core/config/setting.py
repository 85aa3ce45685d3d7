"""One setting, defined once: a config dataclass field carries its type (the annotation), its
default, its help and its range. Everything else is generated from the field: the range check when
a config is built, and the command line's options and --help (codex/cli/command.py).

    lr: float = setting(0.0, "AdamW's peak learning rate; 0 = the optimizer's default", ge=0)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A user mistake in the configuration. The CLI turns it into a usage error (exit 2). `keys`:
    the settings it refuses, so that build_config can name the file their values came from."""

    def __init__(self, message: str, keys: tuple[str, ...] = ()):
        super().__init__(message)
        self.keys = keys


@dataclass(frozen=True)
class Range:
    """The values a number may take: ge/gt a lower bound (inclusive/exclusive), le/lt an upper."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, v: float) -> bool:
        if v != v:  # NaN compares false with every bound
            return False
        return not (
            (self.ge is not None and v < self.ge)
            or (self.gt is not None and v <= self.gt)
            or (self.le is not None and v > self.le)
            or (self.lt is not None and v >= self.lt)
        )

    def _low(self) -> tuple[float, bool] | None:
        """(bound, inclusive) below, or None."""
        return (
            (self.ge, True)
            if self.ge is not None
            else (self.gt, False)
            if self.gt is not None
            else None
        )

    def _high(self) -> tuple[float, bool] | None:
        return (
            (self.le, True)
            if self.le is not None
            else (self.lt, False)
            if self.lt is not None
            else None
        )

    def as_inequality(self) -> str:
        """As Click writes a range in --help: x>=0, 0<=x<=1, 0<x<1."""
        low, high = self._low(), self._high()
        left = f"{low[0]}{'<=' if low[1] else '<'}" if low else ""
        right = f"{'<=' if high[1] else '<'}{high[0]}" if high else ""
        if low and not high:
            return f"x{'>=' if low[1] else '>'}{low[0]}"
        return f"{left}x{right}"

    def __str__(self) -> str:
        """As an error message says it: >= 0, > 0, in [0, 1], in (0, 1)."""
        low, high = self._low(), self._high()
        if low and high:
            return f"in {'[' if low[1] else '('}{low[0]}, {high[0]}{']' if high[1] else ')'}"
        if low:
            return f"{'>=' if low[1] else '>'} {low[0]}"
        assert high
        return f"{'<=' if high[1] else '<'} {high[0]}"


def setting(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field with its help and range (ge/gt/le/lt, for numbers). A list default is
    copied for every instance."""
    bounds = (ge, gt, le, lt)
    meta = {"help": help, "range": Range(*bounds) if any(b is not None for b in bounds) else None}
    if isinstance(default, (list, dict)):
        return dataclasses.field(
            default_factory=functools.partial(copy.deepcopy, default), metadata=meta
        )
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Leaf:
    """One settable key of the config tree: `train.lr`, with its field and owning class."""

    key: str
    type: Any
    field: dataclasses.Field

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def range(self) -> Range | None:
        return self.field.metadata.get("range")

    def default(self) -> Any:
        f = self.field
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return f.default


@functools.cache
def type_hints(cls) -> dict:
    """typing.get_type_hints(cls), once a class (read only): it evaluates every annotation
    (strings, under `from __future__ import annotations`) each call, and building a config asks
    for hundreds."""
    return typing.get_type_hints(cls)


def leaves(cls, prefix: str = "") -> Iterator[Leaf]:
    """Every leaf key of dataclass `cls`'s tree, depth first in field order."""
    for f in dataclasses.fields(cls):
        typ = type_hints(cls)[f.name]
        if dataclasses.is_dataclass(typ):
            yield from leaves(typ, prefix + f.name + ".")
        else:
            yield Leaf(prefix + f.name, typ, f)


def check_ranges(cfg, cls=None, prefix: str = "") -> None:
    """Every number of `cfg` inside its field's range, else a ConfigError naming the key, its
    value and the range."""
    for leaf in leaves(cls or type(cfg), prefix):
        if leaf.range is None:
            continue
        value = cfg
        for part in leaf.key.split("."):
            value = getattr(value, part)
        if not leaf.range.holds(value):
            raise ConfigError(
                f"{leaf.key}={value!r} is out of range: expected {leaf.range}", (leaf.key,)
            )
