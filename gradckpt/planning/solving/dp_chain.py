"""The DP's problem and answer as data: the chain of stages, and the schedules it returns.

:class:`Chain` (its :class:`Stage` s and each stage's :class:`Option` s) is what
:func:`gradckpt.planning.solving.chain.build_chain` makes of a profile and what
:class:`gradckpt.planning.solving.dp.ChainDP` and its tables
(:mod:`gradckpt.planning.solving.dp_cells`) read; a :data:`Tree` of
:class:`UnitStep` and :class:`SegmentStep` is the schedule they return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Union

__all__ = [
    "NESTED",
    "TOP",
    "Chain",
    "Option",
    "SegmentStep",
    "Stage",
    "Tree",
    "UnitStep",
    "ceil_div",
    "near_div",
]

TOP, NESTED = 0, 1
#: Choice codes at or above this are segments a..a+k-1 with k = code - _SEGMENT
#: (relative to the cell's first stage, so shared cells share their choices).
_SEGMENT = 1 << 16


@dataclass(frozen=True)
class Option:
    """One way to run a stage: ``kept`` in grid units, requirements in fine units, time in s."""

    name: str
    kept: int
    fwd: int
    fwd_nested: int
    bwd: int
    time: float


@dataclass(frozen=True)
class Stage:
    """One unit of the chain.

    ``input`` is in grid units; ``none``/``none_nested`` (forward requirement
    when run inside a segment) and ``grad`` (bytes its backward leaves live
    until the end of the step) are in fine units.
    """

    input: int
    options: tuple[Option, ...]
    none: int
    none_nested: int
    fwd_time: float
    joins_previous: bool
    grad: int = 0


@dataclass(frozen=True)
class Chain:
    stages: tuple[Stage, ...]
    capacity: int  # the largest m the tables cover, in grid units
    scale: int = 1  # fine units per grid unit


class UnitStep(NamedTuple):
    """A schedule step: stage ``stage`` run alone in its option ``option``."""

    stage: int
    option: int


class SegmentStep(NamedTuple):
    """A schedule step: the next stages run once keeping nothing but their input,
    recomputed in backward by their own ``schedule``."""

    schedule: list[Union[UnitStep, SegmentStep]]  # noqa: UP007


# A schedule: its steps in forward order.
Tree = list[Union[UnitStep, SegmentStep]]  # noqa: UP007


def ceil_div(value: int, scale: int) -> int:
    """Fine units to grid units, rounded up (requirements)."""
    return -(-value // scale)


def near_div(value: int, scale: int) -> int:
    """Fine units to grid units, rounded to nearest (held bytes: errors cancel)."""
    return (2 * value + scale) // (2 * scale)
