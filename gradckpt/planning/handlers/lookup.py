"""What the chain builder hands a kind's handler besides the profile: a :class:`Lookup`.

Built once per chain (:func:`build_lookup`) so a deep model costs linear time
while every kind offers and costs its options unit by unit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gradckpt.profiling.records import PackRecord, Profile, UnitRecord

__all__ = ["Lookup", "build_lookup", "recompute_end"]


@dataclass(frozen=True)
class Lookup:
    """Indexes of a profile that the builder reads once per unit and option: built in
    one pass, so a deep model costs linear time here, not units x profile size."""

    packs: dict[int, list[PackRecord]]  # unit index -> its packs
    forward_positions: list[int]  # position of each forward op
    #: What the decision kinds read besides the profile: the chain's units in order
    #: (a kind may cost a stage by its neighbours) and per Decision class the
    #: settings ``build_chain`` was given for it (e.g. a link's bandwidth).
    units: tuple[UnitRecord, ...] = ()
    settings: Mapping[type, Any] = field(default_factory=dict)


def build_lookup(
    profile: Profile, units: tuple[UnitRecord, ...] = (), settings: Mapping[type, Any] | None = None
) -> Lookup:
    """The :class:`Lookup` of ``profile`` for a chain of ``units`` built with ``settings``.

    Example:
        >>> build_lookup(prof).packs[0]  # the saved tensors of unit 0
    """
    packs: dict[int, list[PackRecord]] = {}
    for p in profile.packs:
        packs.setdefault(p.unit, []).append(p)
    positions = [op.position for op in profile.ops[: profile.forward_ops]]
    return Lookup(packs, positions, units, dict(settings or {}))


def recompute_end(profile: Profile, unit: UnitRecord, look: Lookup | None = None) -> int:
    """The op index a recompute of ``unit`` stops at: after its last saved tensor's op.

    Example:
        >>> recompute_end(prof, prof.blocks[0]) <= prof.blocks[0].end_op
        True
    """
    look = look or build_lookup(profile)
    done = [p.ops_done for p in look.packs.get(unit.index, ())]
    return min(max(done, default=unit.first_op), unit.end_op)
