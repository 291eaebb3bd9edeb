"""Op and step times measured once per process, reused by every later profile.

A profile's times are measurements, and a few percent of noise is enough to
tip the planner between two near-equal plans, so two profiles of one model
gave two plans. The first measurement of an op signature (device, op, phase,
FLOPs, output sizes) and of a model's plain step (fingerprint and input shapes)
and of a unit's engine timings (:mod:`gradckpt.profiling.unit_costs`) is kept
for the process; later profiles take it, so planning the same model and budget
again gives the same plan. :func:`forget` drops what was kept (to
measure afresh, e.g. after the machine's load changed).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

__all__ = ["forget", "settled_step_time", "settled_times", "settled_unit_times"]

T = TypeVar("T")
_OP_TIMES: dict[Hashable, float] = {}
_STEP_TIMES: dict[Hashable, float] = {}
_UNIT_TIMES: dict[Hashable, object] = {}


def settled_times(signatures: Sequence[Hashable], times: Sequence[float]) -> list[float]:
    """Each op's time: the first one measured for its signature in this process.

    Example:
        >>> settled_times([("cpu", "aten.mm", False, 8, (64,))], [1e-5])
        [1e-05]
    """
    return [_OP_TIMES.setdefault(s, t) for s, t in zip(signatures, times)]


def settled_step_time(key: Hashable, seconds: float) -> float:
    """The plain step's time: the first one measured for ``key`` in this process.

    Example:
        >>> settled_step_time(("fingerprint", ()), 0.2)
        0.2
    """
    return _STEP_TIMES.setdefault(key, seconds)


def settled_unit_times(key: Hashable, measure: Callable[[], T]) -> T:
    """A unit's engine timings: measured (``measure()``) the first time ``key`` is seen
    in this process, the same answer after (:mod:`gradckpt.profiling.unit_costs`).

    Example:
        >>> settled_unit_times(("cpu", "fp", "blocks.0", ((8, 16),)), lambda: times)
    """
    if key not in _UNIT_TIMES:
        _UNIT_TIMES[key] = measure()
    return _UNIT_TIMES[key]  # type: ignore[return-value]


def forget() -> None:
    """Drop every kept time, the engine's costs too: the next profile measures afresh
    (as a new process would).

    Example:
        >>> gradckpt.profiling.calibration.forget()
    """
    _OP_TIMES.clear()
    _STEP_TIMES.clear()
    _UNIT_TIMES.clear()
    from gradckpt.measure.engine_costs import forget as forget_engine_costs

    forget_engine_costs()
