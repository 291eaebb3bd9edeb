"""The simulator's event line: positions, allocations and frees, and what every
simulation of one profile shares.

:class:`EventLine` collects a plan's allocations and frees at sortable
positions (:class:`Position`) and turns them into live bytes per event;
:func:`shared_events` builds, once per profile, the events no plan changes
(backward allocations, each op's workspace) and the forward storages every
simulation reads. :mod:`gradckpt.planning.simulation.simulate` edits the line per plan.

Example:
    >>> line = EventLine(static=shared_events(prof).static)
    >>> line.add(4096, plain_at(3), plain_at(9))
    >>> positions, lives = line.trace()
"""

from __future__ import annotations

import bisect
import itertools
import operator
from dataclasses import dataclass
from typing import NamedTuple

from gradckpt.measure.allocator import allocator_block_bytes
from gradckpt.planning.simulation.per_profile import per_profile
from gradckpt.profiling.records import NEVER, Profile

__all__ = [
    "EventLine",
    "ForwardStorage",
    "Position",
    "SharedEvents",
    "Workspace",
    "plain_at",
    "shared_events",
]


class Position(NamedTuple):
    """A place on the simulated event line; positions sort in the order events happen.

    A recompute's events sit just before the event that triggers it (its first
    unpack): ``step`` one less, ``phase`` 0, ordered among themselves by
    ``depth`` (a nested recompute runs inside its parent's) and ``offset``.
    The line holds positions as plain tuples in this field order: they compare
    the same, and list.sort compares plain tuples fastest (building NamedTuples
    cost a tenth of a simulation, and mixing them with plain tuples a twentieth,
    measured). Read one with ``Position._make(position)``.
    """

    step: int  # the plain step's position (see gradckpt.profiling.records)
    phase: int  # 0: a recompute's event, placed before the plain event at step + 1; 1: plain
    depth: int  # nesting depth of the recompute (0 outside any)
    offset: float  # inside a recompute: op k of the region at k, frees between ops at +-0.5


class Workspace(NamedTuple):
    """A kernel's workspace on the line: its bytes and the op that held it."""

    nbytes: int
    op: int


class ForwardStorage(NamedTuple):
    """A storage made in the forward, as every simulation of a profile reads it."""

    id: int
    nbytes: int  # as the line counts them (allocator blocks on CUDA)
    alloc: tuple  # a Position
    free: int  # where it dies before any plan keeps it (natural free, or its measured free)
    packs: tuple[int, ...]  # saved tensors holding it


class EventLine:
    """Allocations and frees as (position, -delta); positions are sortable tuples.

    The delta is stored negated so that a plain sort puts, at one position,
    allocations before frees. ``static`` holds events every plan of the profile
    shares, already sorted (see :func:`shared_events`).
    """

    def __init__(self, cuda: bool = False, static: tuple[list, dict] | None = None) -> None:
        self.events: list[tuple[tuple, int]] = []
        self.cuda = cuda
        self.static: list[tuple[tuple, int]] = static[0] if static else []
        # position -> (bytes, op)
        self.workspace_of: dict[tuple, Workspace] = dict(static[1]) if static else {}

    def add(self, nbytes: int, alloc: tuple, free: tuple | None) -> None:
        if self.cuda:
            nbytes = allocator_block_bytes(nbytes)
        self.events.append((alloc, -nbytes))
        if free is not None:
            self.events.append((free, nbytes))

    def transient(self, nbytes: int, at: tuple, op: int) -> None:
        """``nbytes`` held only while the op at ``at`` runs, on top of its outputs."""
        if nbytes <= 0:
            return
        # After the op's outputs appear (the same position, allocations first)
        # and gone before anything else happens.
        self.events.append((at, -nbytes))
        after = (*at[:-1], at[-1] + 0.25)  # the same Position, offset + 0.25
        self.events.append((after, nbytes))
        self.workspace_of[at] = Workspace(nbytes, op)

    def trace(self) -> tuple[list[tuple], list[int]]:
        """Positions and live bytes after each event, in order."""
        # At one position, allocations come before frees (an op's inputs are
        # still alive when its outputs appear). The shared events are one sorted
        # run and this plan's another: the sort merges them in linear time.
        self.events.sort()
        events = self.static + self.events
        events.sort()
        positions = list(map(operator.itemgetter(0), events))
        lives = list(itertools.accumulate(map(operator.neg, map(operator.itemgetter(1), events))))
        return positions, lives


@dataclass(frozen=True)
class SharedEvents:
    """What every simulation of one profile reads the same way, built once per profile
    (the solver simulates dozens of plans of one profile)."""

    #: Sorted events no plan changes: backward allocations and each op's workspace.
    static: tuple[list, dict]
    #: Per storage: bytes as the line counts them (allocator blocks on CUDA).
    nbytes: list[int]
    #: Per storage: forward ops completed when it dies naturally (NEVER: outlives the forward).
    natural_op: list[int]
    #: Storages made in the forward.
    forward: list[ForwardStorage]


@per_profile
def shared_events(profile: Profile) -> SharedEvents:
    """What every simulation of ``profile`` shares (built once per profile).

    Example:
        >>> len(shared_events(prof).forward)  # storages made in the forward
    """
    cuda = profile.device == "cuda"
    line = EventLine(cuda=cuda)
    for s in profile.storages:
        if s.producer >= profile.forward_ops:
            line.add(s.nbytes, plain_at(s.alloc), None if s.free == NEVER else plain_at(s.free))
    for op in profile.ops:
        line.transient(op.workspace, plain_at(op.position), op.index)
    line.events.sort()
    positions = [op.position for op in profile.ops[: profile.forward_ops]]
    natural = [
        NEVER if s.natural_free == NEVER else bisect.bisect_left(positions, s.natural_free)
        for s in profile.storages
    ]
    nbytes = [allocator_block_bytes(s.nbytes) if cuda else s.nbytes for s in profile.storages]
    packs_of: dict[int, list[int]] = {}
    for pack in profile.packs:
        if pack.storage >= 0:
            packs_of.setdefault(pack.storage, []).append(pack.id)
    forward = [
        ForwardStorage(s.id, nbytes[s.id], plain_at(s.alloc),
                        s.natural_free if s.natural_free != NEVER else s.free,
                        tuple(packs_of.get(s.id, ())))
        for s in profile.storages if s.producer < profile.forward_ops
    ]  # fmt: skip
    return SharedEvents((line.events, line.workspace_of), nbytes, natural, forward)


def plain_at(position: int) -> tuple:
    """The plain step's own event at ``position`` (a Position, as a plain tuple).

    Example:
        >>> plain_at(12) < (13, 0, 0, 0.0)  # before a recompute triggered at position 13
        True
    """
    return (position, 1, 0, 0.0)
