"""The simulator's regions: a plan's checkpointed regions in profile terms.

``regions_of(profile, plan)`` turns the plan's items into :class:`Region` trees
(a unit's region comes from its kind's handler; a segment spans consecutive
chained units) and gives every saved tensor to the regions spanning it. The
simulator (:mod:`gradckpt.planning.simulation.simulate`), the engine-cost model and
``explain`` read them.

Example:
    >>> [r.units for r in regions_of(prof, plan)]
"""

from __future__ import annotations

import itertools

from gradckpt.planning.handlers.plan_parts import plan_parts
from gradckpt.planning.handlers.region import Region
from gradckpt.planning.handlers.registry import handler_for
from gradckpt.planning.plans.plan import Plan, Segment, UnitChoice, iter_units
from gradckpt.profiling.records import Profile

__all__ = ["regions_of"]


def _unit_index(profile: Profile) -> dict[str, int]:
    return {u.path: u.index for u in profile.units}


def _region(profile: Profile, item: UnitChoice | Segment, index: dict[str, int]) -> Region | None:
    if isinstance(item, UnitChoice):  # what the unit's decision opens, if anything
        unit = profile.units[index[item.path]]
        return handler_for(item.decision).region(profile, unit, item.decision)
    units = [profile.units[index[u.path]] for u in iter_units(item.items)]
    for before, after in itertools.pairwise(units):
        if after.index != before.index + 1 or not after.chained:
            raise ValueError(
                f"a segment must span consecutive units that hand their output to the next; "
                f"{before.path} -> {after.path} is not such a step in the profiled forward"
            )
    inputs = set(units[0].inputs)
    for u in units[1:]:
        inputs.update(s for s in u.inputs if s != u.chain_input)
    children = [r for r in (_region(profile, i, index) for i in item.items) if r is not None]
    return Region(
        [u.index for u in units], units[0].first_op, units[-1].end_op, frozenset(),
        frozenset(inputs), children,
    )  # fmt: skip


def regions_of(profile: Profile, plan: Plan) -> list[Region]:
    """The plan's top-level regions, with every pack assigned to the regions spanning it.

    Example:
        >>> regions_of(prof, every_kth_plan(prof, 1))[0].packs  # saved tensors of the first block
    """
    index = _unit_index(profile)
    missing = [u.path for u in plan.units if u.path not in index]
    if missing:
        raise ValueError(f"the plan names units the profile does not have: {missing}")
    tops = [r for r in (_region(profile, i, index) for i in plan.items) if r is not None]
    owner: dict[int, list[Region]] = {}

    def assign(region: Region, chain: list[Region]) -> None:
        for u in region.units:
            owner.setdefault(u, [])
        for child in region.children:
            assign(child, [*chain, child])
        for u in region.units:
            if not owner[u] or len(owner[u]) < len(chain):
                owner[u] = chain

    for top in tops:
        assign(top, [top])
    for pack in profile.packs:
        for region in owner.get(pack.unit, ()):
            region.packs.append(pack.id)
    for part in plan_parts():  # e.g. MLPs in slices: regions of their own, in their blocks'
        tops = part.regions(profile, plan, tops)
    return tops
