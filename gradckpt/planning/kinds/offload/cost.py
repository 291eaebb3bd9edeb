"""What offloading costs, as pure functions: transfers, overlap, stalls, host bytes.

The link is a parameter (bytes per second in each direction, and a fixed cost
per storage moved: the copy's launch, its event, the hook's Python). On a GPU
it would be measured at start-up; on a CPU-only machine it is whatever the
caller states, and every time derived from it is a *simulation*.

Transfers run on one copy queue, in the order they are issued, while compute
runs on; compute stalls only when it waits for a transfer that has not
finished. :func:`run_timeline` plays such a schedule (compute spans, issues,
waits) and returns the stalls; the simulator builds the schedule from the
profile, and the chain DP uses :func:`unit_stall`, the same rule for one unit
with its neighbours' compute as the windows.

The link's settings are :class:`~gradckpt.planning.plans.offload_options.OffloadOptions`
(plan data: a plan file carries them).

Example:
    >>> options = OffloadOptions(d2h_bandwidth=25e9, h2d_bandwidth=25e9)
    >>> transfer_seconds(1 << 30, 1, options.d2h_bandwidth, 0.0)  # 1 GiB at 25 GB/s
    0.04294967296
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

__all__ = [
    "Compute",
    "Issue",
    "Timeline",
    "Wait",
    "exposed_seconds",
    "run_timeline",
    "transfer_seconds",
    "unit_stall",
]


def transfer_seconds(nbytes: int, count: int, bandwidth: float, latency: float) -> float:
    """Seconds to move ``nbytes`` in ``count`` storages over a link of ``bandwidth`` B/s.

    Example:
        >>> transfer_seconds(50_000_000_000, 1, 50e9, 0.0)  # 50 GB at 50 GB/s
        1.0
    """
    if nbytes <= 0 and count <= 0:
        return 0.0
    return count * latency + nbytes / bandwidth


def exposed_seconds(transfer: float, window: float) -> float:
    """What a transfer of ``transfer`` seconds adds to a step when ``window`` seconds
    of compute may hide it.

    Example:
        >>> exposed_seconds(3.0, 2.0), exposed_seconds(1.0, 2.0)
        (1.0, 0.0)
    """
    return max(0.0, transfer - max(0.0, window))


def unit_stall(d2h: float, h2d: float, forward_window: float, backward_window: float) -> float:
    """Stall of offloading one unit, with its neighbours' compute as the windows.

    The copy out overlaps the forward of the units run before the stash drops
    the sources (the next offloaded unit's forward); the copy back, the
    backward between its prefetch and its first use.

    Example:
        >>> unit_stall(d2h=1.0, h2d=1.0, forward_window=0.5, backward_window=2.0)
        0.5
    """
    return exposed_seconds(d2h, forward_window) + exposed_seconds(h2d, backward_window)


@dataclass(frozen=True)
class Compute:
    """``seconds`` of compute on the compute stream."""

    seconds: float


@dataclass(frozen=True)
class Issue:
    """Queue a transfer ``key`` taking ``seconds`` on the copy queue (compute runs on)."""

    key: Any
    seconds: float


@dataclass(frozen=True)
class Wait:
    """Compute waits until transfer ``key`` has finished."""

    key: Any


Step = Union[Compute, Issue, Wait]  # noqa: UP007


@dataclass(frozen=True)
class Timeline:
    """What :func:`run_timeline` found: total and per-wait stalls, finish times."""

    stall: float
    end: float
    waits: dict[Any, float]
    finish: dict[Any, float]


def run_timeline(steps: Sequence[Step]) -> Timeline:
    """Play ``steps`` on one compute stream and one serial copy queue.

    A transfer starts when it is issued and the queue is free; a wait stalls
    compute until that transfer finishes. Waiting for a key never issued is an
    error (the schedule is wrong), as is issuing a key twice.

    Example:
        >>> run_timeline([Issue("a", 3.0), Compute(2.0), Wait("a")]).stall
        1.0
    """
    now = 0.0
    queue_free = 0.0
    finish: dict[Any, float] = {}
    waits: dict[Any, float] = {}
    stall = 0.0
    for step in steps:
        if isinstance(step, Compute):
            now += max(0.0, step.seconds)
        elif isinstance(step, Issue):
            if step.key in finish:
                raise ValueError(f"transfer {step.key!r} issued twice")
            start = max(now, queue_free)
            queue_free = finish[step.key] = start + max(0.0, step.seconds)
        elif isinstance(step, Wait):
            if step.key not in finish:
                raise ValueError(f"wait for transfer {step.key!r}, which was never issued")
            late = max(0.0, finish[step.key] - now)
            waits[step.key] = late
            stall += late
            now += late
        else:
            raise TypeError(f"not a timeline step: {step!r}")
    return Timeline(stall, now, waits, finish)
