"""The engine's own costs in a plan's predicted time: pure functions of counts.

What a plan costs beyond the ops it recomputes is a count of engine events
times their measured unit costs (:class:`~gradckpt.measure.engine_costs.EngineCosts`):

* every region (a unit's region or a segment) is entered in the forward and
  once in the recompute: ``region`` each;
* every op a recompute runs up to its early stop costs ``lean_op`` (the lean
  path: the saved-tensor hooks alone), or ``recompute_op`` in a region that
  replays kept outputs (a selective one), whose recompute runs every op, kept
  ones included, through its dispatch mode;
* every op of a selective region's forward is shown to its policy:
  ``policy_op`` each;
* every tensor autograd saves inside a region goes through the pack hook in
  the forward and in each recompute that reaches it, and the unpack hook:
  ``saved_tensor`` each time a recompute covers it;
* a recomputed op also reruns the Python and autograd work around its kernel,
  which op times leave out: the plain step's untimed seconds per op
  (:func:`untimed_per_op`).

The counts are deterministic (ops and saved tensors of the profile); only the
unit costs are measured, once per process. :func:`plan_counts` and
:func:`engine_seconds` are what the simulator adds to its time;
:func:`~gradckpt.planning.solving.chain.with_engine_costs` adds the same costs to the DP's options, so the
solver weighs a selective region's policy against the recompute it saves.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from gradckpt.engine.decisions import Decision, decision_from_json
from gradckpt.measure.engine_costs import EngineCosts
from gradckpt.planning.handlers.engine_counts import EngineCounts
from gradckpt.planning.handlers.region import Region
from gradckpt.planning.handlers.registry import handler_for
from gradckpt.planning.simulation.per_profile import per_profile
from gradckpt.profiling.records import Profile, UnitRecord

__all__ = [
    "engine_seconds",
    "plan_counts",
    "region_counts",
    "steady",
    "step_costs",
    "unit_counts",
    "untimed_per_op",
]


@per_profile
def untimed_per_op(profile: Profile) -> float:
    """Seconds of the plain step outside its timed kernels, per op (Python, autograd).

    Op times are taken around each kernel; the module code around the ops and
    autograd's graph bookkeeping run again in a recompute too, and on small ops
    they cost as much as the kernels.

    Example:
        >>> untimed_per_op(prof) * 100  # what rerunning 100 ops costs beyond their kernels
    """
    if not profile.ops:
        return 0.0
    return max(0.0, profile.step_time - sum(op.time for op in profile.ops)) / len(profile.ops)


@per_profile
def step_costs(profile: Profile) -> EngineCosts:
    """The profile's engine costs per event, as the planner prices them.

    Per region, saved tensor and recomputed op, the tiny chains' costs, a
    recomputed op also paying the plain step's untimed work per op
    (:func:`untimed_per_op`). Per op of a selective region's forward, what
    asking a policy added to the model's own block's region forward, when the
    profile timed one (:mod:`gradckpt.profiling.unit_costs`). Every cost is then
    put on a grid of 1/8 octave (:func:`steady`): jitter below that moves no plan.

    A recomputed op is not priced from the timed block: what its region paid beyond
    its plain run, its kernels, its entry and its saved tensors is a small difference
    of large times, and it is noise (issue #31: in 38 fresh profiles of the demo GPT
    under load it read 0 in 26, 8-79 us in the rest, and one of those planned the
    one different plan of the 38; priced from the chains, all 38 planned alike).

    Example:
        >>> engine_seconds(counts, step_costs(prof))
    """
    costs = profile.engine_costs
    unit = next((u for u in profile.units if costs.unit and u.module_path == costs.unit), None)
    scale = _unit_scale(profile, unit, costs) if unit is not None else 1.0
    untimed = untimed_per_op(profile)
    costs = replace(
        costs, region=scale * costs.region, saved_tensor=scale * costs.saved_tensor,
        recompute_op=scale * costs.recompute_op + untimed, lean_op=scale * costs.lean_op + untimed,
    )  # fmt: skip
    if unit is not None and costs.unit_region > 0:
        policy = costs.unit_policy / (unit.end_op - unit.first_op)
        costs = replace(costs, policy_op=max(0.0, policy))
    return replace(
        costs, region=steady(costs.region), recompute_op=steady(costs.recompute_op),
        policy_op=steady(costs.policy_op), saved_tensor=steady(costs.saved_tensor),
        lean_op=steady(costs.lean_op), host_op=steady(costs.host_op),
    )  # fmt: skip


#: How far the timed unit may move the chains' costs: a unit's step is timed a few
#: times on a possibly busy machine, and a wild reading must not set the plan.
_SCALE_RANGE = (0.5, 4.0)


def _unit_scale(profile: Profile, unit: UnitRecord, costs: EngineCosts) -> float:
    """What the engine really costs on the timed unit over what the chains predict for it.

    The unit's region step minus its plain step minus the forward its recompute reruns
    is the engine's part (entry, saved tensors, hooks per op); the chains' costs price the
    unit's events lower on real blocks (ops with weights and views: on the short-op GPT,
    640 us measured against 420 us predicted per block). 1 when the unit was not timed
    as steps.
    """
    if costs.unit_region_step <= 0:
        return 1.0
    measured = costs.unit_region_step - costs.unit_step - costs.unit_forward
    chains = engine_seconds(region_counts(profile, unit, policy=False), costs)
    if measured <= 0 or chains <= 0:
        return 1.0
    low, high = _SCALE_RANGE
    return min(high, max(low, measured / chains))


#: Steps of the grid engine costs are put on: 2 ** (1/8), about 9% apart.
_GRID = 2.0 ** (1 / 8)


def steady(seconds: float) -> float:
    """``seconds`` to the nearest point of a geometric grid 1/8 octave apart (0 stays 0).

    Engine costs are small differences of measured times and move a few percent
    from one process to the next; on the grid, two profiles of one model on one
    machine nearly always price the engine the same, so they plan the same.

    Example:
        >>> steady(1.0), steady(1.03)
        (1.0, 1.0)
    """
    if seconds <= 0:
        return 0.0
    return _GRID ** round(math.log(seconds, _GRID))


def engine_seconds(counts: EngineCounts, costs: EngineCosts) -> float:
    """Seconds the engine adds for ``counts`` events at ``costs`` per event.

    Example:
        >>> engine_seconds(EngineCounts(recompute_ops=10), EngineCosts(lean_op=1e-5))
        0.0001
    """
    return (
        counts.regions * costs.region
        + (counts.recompute_ops - counts.mode_ops) * costs.lean_op
        + counts.mode_ops * costs.recompute_op
        + counts.policy_ops * costs.policy_op
        + counts.saved_tensors * costs.saved_tensor
        + counts.sliced_ops * costs.host_op
    )


def plan_counts(
    profile: Profile, tops: Iterable[Region], recomputed: Iterable[tuple[Region, int]]
) -> EngineCounts:
    """Engine events of a simulated plan: its top regions, and each recompute with its stop.

    ``recomputed`` lists every region the simulator recomputed (nested ones
    inside a segment's recompute too) with the op index its recompute stops at.

    Example:
        >>> plan_counts(prof, regions, [(regions[0], regions[0].end_op)])
    """
    total = EngineCounts()
    for region in tops:  # a chunked region is entered once per slice
        # Slices run their ops again in the forward and backward, nested or not.
        total += EngineCounts(regions=region.repeats, policy_ops=_policy_ops(region),
                              sliced_ops=_sliced_ops(region))  # fmt: skip
    for region, stop in recomputed:
        for child in region.children:  # opened while this recompute runs
            total += EngineCounts(regions=child.repeats, policy_ops=_policy_ops(child))
        ops = max(0, stop - region.first_op) * region.repeats  # a chunked region: per slice
        total += EngineCounts(
            recompute_ops=ops,
            saved_tensors=len(region.packs) * region.repeats,
            mode_ops=ops if region.save else 0,  # kept outputs: replayed under the mode
        )
    return total


def _sliced_ops(region: Region) -> int:
    """Ops the slices of ``region`` and of the chunked regions inside it run again."""
    own = (region.repeats - 1) * region.slice_ops
    return own + sum(_sliced_ops(child) for child in region.children)


def _policy_ops(region: Region) -> int:
    return region.end_op - region.first_op if region.save else 0


@per_profile
def _packs_by_unit(profile: Profile) -> dict[int, list[int]]:
    """Each unit's packs' ``ops_done``: one pass, not one per unit (deep models)."""
    done: dict[int, list[int]] = {}
    for p in profile.packs:
        done.setdefault(p.unit, []).append(p.ops_done)
    return done


def _stop(profile: Profile, unit: UnitRecord) -> int:
    done = _packs_by_unit(profile).get(unit.index, ())
    return min(max(done, default=unit.first_op), unit.end_op)


def region_counts(profile: Profile, unit: UnitRecord, *, policy: bool) -> EngineCounts:
    """Engine events of one unit run as its own region (``policy``: its ops go to a policy).

    Example:
        >>> region_counts(prof, prof.blocks[0], policy=True).policy_ops
    """
    packs = len(_packs_by_unit(profile).get(unit.index, ()))
    ops = _stop(profile, unit) - unit.first_op
    return EngineCounts(
        regions=1,
        recompute_ops=ops,
        policy_ops=unit.end_op - unit.first_op if policy else 0,
        saved_tensors=packs,
        mode_ops=ops if policy else 0,  # a policy's region keeps outputs: replays them
    )


def unit_counts(profile: Profile, unit: UnitRecord, decision: Decision | str) -> EngineCounts:
    """Engine events of one unit run as ``decision`` (or a kind name; keep: none).

    Example:
        >>> unit_counts(prof, prof.blocks[0], Selective()).policy_ops
    """
    if isinstance(decision, str):
        decision = decision_from_json(decision, {})
    return handler_for(decision).engine_counts(profile, unit, decision)
