"""``StepEffect``: what a decision kind does to the simulated step as a whole.

Most kinds act on their own unit only (the region it opens, if any). A kind
whose units interact across the plan (``Offload``: a one-deep stash, reload
buffers prefetched a unit early, one copy queue) returns a :class:`StepEffect`
from :meth:`KindHandler.plan_effect <gradckpt.planning.handlers.registry.KindHandler.plan_effect>`,
and the simulator (:mod:`gradckpt.planning.simulation.simulate`) applies it to the event
line without knowing the kind. Positions are the plain step's (see
:mod:`gradckpt.profiling.records`).

This module imports nothing of the planner, so the handler registry can name it.

Example:
    >>> effect = StepEffect(stall=0.002, host_bytes=1 << 20)
    >>> combined([effect, StepEffect(stall=0.001)]).stall
    0.003
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["Buffer", "StepEffect", "combined"]

@dataclass(frozen=True)
class Buffer:
    """Device bytes the effect allocates at ``alloc`` and frees at ``free`` (e.g. a reload buffer)."""

    nbytes: int  # as allocated (the simulator rounds to allocator blocks on CUDA)
    alloc: int
    free: int


@dataclass(frozen=True)
class StepEffect:
    """A plan-wide change to the plain step's memory and time, in profile terms."""

    #: Saved tensors (pack ids) that stop holding their storage on the device: the
    #: storage no longer lives until their release.
    released_packs: frozenset[int] = frozenset()
    #: Storage id -> position it stays live until at least (e.g. a stash dropping it).
    live_until: Mapping[int, int] = field(default_factory=dict)
    #: Device memory the effect adds.
    buffers: tuple[Buffer, ...] = ()
    #: Seconds compute waits for the effect (e.g. copies on a link); added to the step time.
    stall: float = 0.0
    #: Bytes held in host memory at once.
    host_bytes: int = 0
    #: (unit index, storage id): that unit's own top-level region no longer holds that
    #: input storage for its recompute (it went to host memory; ``buffers`` bring it back).
    released_inputs: frozenset[tuple[int, int]] = frozenset()
    #: Storage id -> bytes it has under the plan, wherever the step makes it (forward,
    #: recompute, backward): a chunked region's per-token storages are one slice's.
    resized: Mapping[int, int] = field(default_factory=dict)


def combined(effects: Iterable[StepEffect]) -> StepEffect | None:
    """One effect doing what all of ``effects`` do (None: there are none).

    Example:
        >>> combined([]) is None
        True
    """
    effects = list(effects)
    if len(effects) <= 1:
        return effects[0] if effects else None
    live_until: dict[int, int] = {}
    for e in effects:
        for sid, position in e.live_until.items():
            live_until[sid] = max(live_until.get(sid, position), position)
    return StepEffect(
        frozenset().union(*(e.released_packs for e in effects)),
        live_until,
        tuple(b for e in effects for b in e.buffers),
        sum(e.stall for e in effects),
        sum(e.host_bytes for e in effects),
        frozenset().union(*(e.released_inputs for e in effects)),
        {s: n for e in effects for s, n in e.resized.items()},
    )
