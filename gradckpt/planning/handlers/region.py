"""A checkpointed region in profile terms: what a kind's handler opens for its unit.

The simulator's regions (:func:`gradckpt.planning.simulation.regions.regions_of`)
are trees of these; a kind that opens a region returns one from
:meth:`KindHandler.region <gradckpt.planning.handlers.registry.KindHandler.region>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Region"]


@dataclass
class Region:
    """A checkpointed region in profile terms (units by index, ops by global index)."""

    units: list[int]
    first_op: int
    end_op: int
    save: frozenset[int] = frozenset()
    inputs: frozenset[int] = frozenset()
    children: list[Region] = field(default_factory=list)
    packs: list[int] = field(default_factory=list)  # all packs in this region's span
    #: How many times the region is entered per step: a chunked region once per slice
    #: (its engine events and kept RNG states count that many times).
    repeats: int = 1
    #: The module a token-wise region runs in slices (an MLP inside a block); "" for a
    #: unit's or a segment's region.
    label: str = ""
    #: Whether backward recomputes it. A linear head's chunked loss does its backward's
    #: work in the forward (:mod:`gradckpt.engine.chunking.linear_loss`): its saved
    #: tensors are dropped as a region's, nothing runs again (the plan's effect places
    #: the backward's storages in the forward).
    reruns: bool = True
    #: Ops one slice of a chunked region runs, forward and backward: each slice beyond
    #: the first pays the host's per-op cost for them again (0: not chunked).
    slice_ops: int = 0
