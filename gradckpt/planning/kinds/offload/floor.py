"""The least peak with offload, and the error that names both floors.

Without offload, the least peak is set by what checkpointing keeps: each
recomputed block's input (or a segment's), plus one block's recompute. With
offload those kept inputs can go to host memory too
(:mod:`gradckpt.planning.kinds.offload.boundary`), so the floor is lower
wherever the boundaries are a real share of it. :func:`least_peak_offload`
finds it the way :func:`~gradckpt.planning.solving.solvers.least_peak_plan`
finds the floor without: the offload chain's DP at its least feasible budget,
pushed lower by the simulator-checked repair moves, beside the uniform plans
(every block's boundary moved; every block offloaded) and the floor without
offload, keeping those whose host bytes fit the host budget.

Example:
    >>> plan, pred = least_peak_offload(prof, OffloadOptions())
    >>> pred.peak_bytes <= least_peak_plan(prof)[1].peak_bytes
    True
"""

from __future__ import annotations

from gradckpt.engine.decisions import KEEP, RECOMPUTE, Offload, RecomputeOffload
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan, UnitChoice
from gradckpt.planning.simulation.simulate import Prediction
from gradckpt.planning.solving.baselines import finish
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.chain import ChainModel, build_chain, with_engine_costs
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.polish import repair
from gradckpt.planning.solving.solvers import _items, least_peak_plan, without_segments
from gradckpt.profiling.records import Profile

__all__ = ["least_peak_offload", "offload_budget_error"]


def _uniform(model: ChainModel, profile: Profile, options: OffloadOptions, kind: type) -> Plan:
    """Every block as its option of ``kind`` (recompute where it has none); the rest kept."""
    items = []
    for unit, choices in zip(model.units, model.options):
        found = next((c for c in choices if isinstance(c, kind)), RECOMPUTE)
        items.append(UnitChoice(unit.path, found if unit.is_block else KEEP))
    return Plan(tuple(items), profile.fingerprint, offload=options)


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
    if m is not None:
        plans.insert(0, Plan(_items(model, dp.schedule(m)), profile.fingerprint, offload=options))
    for plan in plans:
        plan, pred = repair(profile, plan, 0, model)
        candidates.append((plan, pred))
    limit = options.host_budget
    fitting = [(p, q) for p, q in candidates if limit is None or q.host_bytes <= limit]
    plan, pred = min(fitting, key=lambda pair: pair[1].peak_bytes)  # the first on ties
    return finish(profile, plan, None, "dp", pred)


def offload_budget_error(
    budget: int, without: BudgetError, with_offload: Prediction, options: OffloadOptions
) -> BudgetError:
    """The :class:`BudgetError` of a budget no plan meets with offload either: both floors.

    Example:
        >>> raise offload_budget_error(budget, error, least_peak_offload(prof, o)[1], o)
    """
    host = "" if options.host_budget is None else (
        f" within the host budget of {format_bytes(options.host_budget)}"
    )  # fmt: skip
    floor = with_offload.peak_bytes
    return BudgetError(
        f"{without} With offload{host}, the least peak is {format_bytes(floor)} "
        f"({floor} bytes; {format_bytes(with_offload.host_bytes)} on the host), against "
        f"{format_bytes(without.least_peak_bytes or 0)} without: offload moves what blocks "
        "save and the inputs recomputed blocks keep, but parameters, gradients and one "
        "block's recompute stay on the device.",
        least_peak_bytes=min(floor, without.least_peak_bytes or floor),
    )
