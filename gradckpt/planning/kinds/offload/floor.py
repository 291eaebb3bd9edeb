"""The least peak with offload, and the error that names both floors.

Without offload, the least peak is set by what checkpointing keeps: each
recomputed block's input (or a segment's), plus one block's recompute. With
offload those kept inputs can go to host memory too
(:mod:`gradckpt.planning.kinds.offload.boundary`), so the floor is lower
wherever the boundaries are a real share of it; and streamed offload
(:mod:`gradckpt.planning.kinds.offload.stream`) holds a tensor or two of what a
block saved in its backward, not all of it, so the floor goes below one
block's recompute. :func:`least_peak_offload` finds the floor the way
:func:`~gradckpt.planning.solving.solvers.least_peak_plan` finds it without
(each candidate tried both grouped and streamed): the offload chain's DP at
its least feasible budget, pushed lower by the simulator-checked repair moves,
beside the uniform plans (every block's boundary moved; every block offloaded;
under a host budget, as many boundaries as it holds, from either end) and the
floor without offload, keeping those whose host bytes fit the host budget (a
search over these candidates, not an optimum, when the host budget binds).

Example:
    >>> plan, pred = least_peak_offload(prof, OffloadOptions())
    >>> pred.peak_bytes <= least_peak_plan(prof)[1].peak_bytes
    True
"""

from __future__ import annotations

from dataclasses import replace

from gradckpt.engine.decisions import KEEP, RECOMPUTE, Offload, RecomputeOffload
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.kinds.offload.boundary import offloadable_boundary
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan, UnitChoice
from gradckpt.planning.simulation.simulate import Prediction, simulate
from gradckpt.planning.solving.baselines import finish
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.chain import ChainModel, build_chain, with_engine_costs
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.polish import repair
from gradckpt.planning.solving.solvers import _items, least_peak_plan, without_segments
from gradckpt.profiling.records import Profile

__all__ = ["least_peak_offload", "offload_budget_error"]


def _uniform(
    model: ChainModel, profile: Profile, options: OffloadOptions, kind: type,
    room: int | None = None, reverse: bool = False,
) -> Plan:  # fmt: skip
    """Every block as its option of ``kind`` (recompute where it has none); the rest kept.

    ``room``: host bytes the moved inputs may take (``RecomputeOffload`` only); blocks
    past it, taken in forward order (``reverse``: backward order), are recomputed.
    """
    decided: dict[str, object] = {}
    pairs = list(zip(model.units, model.options))
    for unit, choices in reversed(pairs) if reverse else pairs:
        found = next((c for c in choices if isinstance(c, kind)), RECOMPUTE)
        if room is not None and found is not RECOMPUTE:
            sid = offloadable_boundary(profile, unit, options.min_bytes)
            size = profile.storages[sid].nbytes if sid is not None else 0
            if size > room:
                found = RECOMPUTE
            room -= size if found is not RECOMPUTE else 0
        decided[unit.path] = found if unit.is_block else KEEP
    items = tuple(UnitChoice(u.path, decided[u.path]) for u in model.units)
    return Plan(items, profile.fingerprint, offload=options)


def _offloads_blocks(plan: Plan) -> bool:
    return any(isinstance(i, UnitChoice) and isinstance(i.decision, Offload) for i in plan.items)


def least_peak_offload(
    profile: Profile, options: OffloadOptions, *, model: ChainModel | None = None,
    segments: bool = True,
) -> tuple[Plan, Prediction]:  # fmt: skip
    """The leanest plan with offload over ``options``' link whose host bytes fit its host
    budget, with predictions (its ``peak_bytes`` is the least peak with offload).

    Never above the floor without offload (that plan is one of the candidates).

    Example:
        >>> least_peak_offload(prof, OffloadOptions(host_budget=1 << 30))[1].peak_bytes
    """
    model = model or with_engine_costs(build_chain(profile, settings={Offload: options}), profile)
    if not segments:
        model = without_segments(model)
    candidates = [least_peak_plan(profile, segments=segments)]
    dp = ChainDP(model.chain)
    m = dp.least_feasible()
    plans = [_uniform(model, profile, options, RecomputeOffload),
             _uniform(model, profile, options, Offload)]  # fmt: skip
    if options.host_budget is not None:  # as many inputs as the host holds, from either end
        plans += [_uniform(model, profile, options, RecomputeOffload, options.host_budget, r)
                  for r in (False, True)]  # fmt: skip
    if m is not None:
        plans.insert(0, Plan(_items(model, dp.schedule(m)), profile.fingerprint, offload=options))
    if not options.stream:  # each that offloads blocks again, with them streamed
        streamed = replace(options, stream=True)
        plans += [replace(p, offload=streamed) for p in plans if _offloads_blocks(p)]
    for plan in plans:
        # Repaired (lower, but its moves may offload more than the host holds) and as built.
        candidates += [repair(profile, plan, 0, model), (plan, simulate(profile, plan))]
    limit = options.host_budget
    fitting = [(p, q) for p, q in candidates if limit is None or q.host_bytes <= limit]
    plan, pred = min(fitting, key=lambda pair: pair[1].peak_bytes)  # the first on ties
    return finish(profile, plan, None, "dp", pred)


def offload_budget_error(
    without: BudgetError, with_offload: Prediction, options: OffloadOptions
) -> BudgetError:
    """The :class:`BudgetError` of a budget no plan meets with offload either: both floors
    (``without``: the error without offload; ``with_offload``: the leanest plan's prediction).

    Example:
        >>> raise offload_budget_error(error, least_peak_offload(prof, o)[1], o)
    """
    host = "" if options.host_budget is None else (
        f" within the host budget of {format_bytes(options.host_budget)}"
    )  # fmt: skip
    floor = with_offload.peak_bytes
    return BudgetError(
        # Rounded up, as the message before it: a budget of what it says fits.
        f"{without} With offload{host}, the least peak is {format_bytes(floor, round_up=True)} "
        f"({floor} bytes; {format_bytes(with_offload.host_bytes)} on the host), against "
        f"{format_bytes(without.least_peak_bytes or 0, round_up=True)} without: offload "
        "moves what blocks save (streamed, a tensor at a time, where that is leaner) and "
        "the inputs recomputed blocks keep, but parameters, gradients, code outside the "
        "blocks (the loss) and the tensors in use stay on the device.",
        least_peak_bytes=min(floor, without.least_peak_bytes or floor),
    )
