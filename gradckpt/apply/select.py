"""Close the loop: run the most promising plans for a few real steps, keep the fastest.

The planner ranks plans by predicted time, and a prediction can be wrong by
more than the gap between two plans that fit (the engine's Python per op,
allocator work, ops running colder in a recompute than when profiled). So
``fit`` takes the few candidates that fit the budget (the DP's plan; the best
*whole-unit* plan, each unit kept or recomputed whole as per-layer
checkpointing does, so the pick is never a selective plan that measured
clearly slower than per-layer checkpointing at the same memory; then the
baselines and leaner DP plans predicted fastest), runs each for ``rounds``
real steps interleaved with the plain step (plain, A, B, plain, A, B, ...),
and keeps the one whose median step ratio is lowest. The kept plan records
its predicted and measured overhead.

Cost: ``rounds * (candidates + 1)`` training steps (9 with the defaults),
plus one ``apply``/``remove`` per candidate step. The model, its gradients,
buffers and the RNG are left as found.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from gradckpt.apply.apply import apply, remove
from gradckpt.engine.decisions import Keep, Recompute
from gradckpt.measure.timing import work_clock
from gradckpt.planning.budget import BudgetError
from gradckpt.planning.chain import ChainModel
from gradckpt.planning.plan import Plan, UnitChoice
from gradckpt.planning.planner import Planner
from gradckpt.planning.solvers import finish, solve, solve_dp
from gradckpt.profiling.records import Profile
from gradckpt.profiling.state import StepState

__all__ = ["candidate_plans", "fastest_measured", "pick_fastest", "whole_unit_plan"]

#: Baselines that become candidates when they fit (sqrt only where segments are allowed).
_BASELINES = ("every_kth", "save_matmuls", "every_block", "sqrt")
#: Leaner budgets (shares of the budget) the DP is also asked at: other trade-offs that fit.
_LEANER = (0.97, 0.92)
#: A candidate must beat the predicted-best one by this share of the plain step to
#: replace it: closer than that, the measurement cannot tell them apart.
MARGIN = 0.03
#: The decisions that keep or recompute a unit whole (per-layer checkpointing's shape).
_WHOLE = (Keep, Recompute)


def _planner(source: Profile | Planner, segments: bool) -> Planner:
    return source if isinstance(source, Planner) else Planner(source, segments=segments)


def _whole_units(model: ChainModel) -> ChainModel:
    """The DP chain with each unit's selective options removed and no segments."""
    picks = [[i for i, o in enumerate(opts) if type(o) in _WHOLE] for opts in model.options]
    stages = tuple(
        replace(stage, options=tuple(stage.options[i] for i in pick), joins_previous=False)
        for stage, pick in zip(model.chain.stages, picks)
    )
    options = tuple(tuple(opts[i] for i in pick) for opts, pick in zip(model.options, picks))
    return replace(model, chain=replace(model.chain, stages=stages), options=options)


def _whole(items: tuple) -> bool:
    return all(isinstance(i, UnitChoice) and type(i.decision) in _WHOLE for i in items)


def whole_unit_plan(source: Profile | Planner, budget: int) -> Plan | None:
    """The least-time plan within ``budget`` whose units are each kept or recomputed whole.

    That is per-layer checkpointing at its best (the DP picks which units to
    recompute; no selective units, no segments), or None when none fits.
    ``source``: the profile, or a Planner (its chain is reused).

    Example:
        >>> whole_unit_plan(prof, 300 << 20).predicted_overhead
    """
    planner = _planner(source, segments=False)
    model = _whole_units(planner.chain)
    try:
        plan = solve_dp(planner.profile, budget, model=model, segments=False)
    except BudgetError:
        return None
    return plan if _whole(plan.items) else None  # a fallback may have made other shapes


def candidate_plans(
    source: Profile | Planner, chosen: Plan, count: int, *, segments: bool = True
) -> list[Plan]:
    """``chosen`` and up to ``count - 1`` other plans that fit its budget.

    The best whole-unit plan (:func:`whole_unit_plan`) comes second whenever it
    fits and differs from ``chosen``; the others follow, fastest predicted first.

    ``source``: the profile, or the :class:`~gradckpt.planning.planner.Planner` that
    made ``chosen`` (its chain and DP are then reused; ``segments`` is its own).

    Example:
        >>> candidate_plans(prof, gradckpt.plan(model, loss_fn, 0.5, profile=prof), 2)
    """
    planner = _planner(source, segments)
    profile = planner.profile
    budget = chosen.budget_bytes
    found = [chosen]
    whole = None
    if budget is not None and count > 1 and not _whole(chosen.items):
        whole = whole_unit_plan(planner, budget)
    if budget is not None and count > 1:
        for name in _BASELINES:
            if name == "sqrt" and not planner.segments:
                continue
            try:
                found.append(solve(profile, budget, name))
            except (BudgetError, ValueError):
                continue
        for share in _LEANER:
            try:
                leaner = planner.plan(int(budget * share))
            except BudgetError:
                continue
            found.append(finish(profile, leaner, budget, "dp")[0])
    unique: dict[tuple, Plan] = {chosen.items: chosen}
    if whole is not None:
        unique.setdefault(whole.items, whole)
    for plan in found:
        unique.setdefault(plan.items, plan)
    first = [chosen] + (
        [unique[whole.items]] if whole is not None and whole.items != chosen.items else []
    )
    others = sorted(
        (p for p in unique.values() if all(p is not f for f in first)),
        key=lambda p: p.predicted_step_time,
    )
    return [*first, *others][: max(1, count)]


def pick_fastest(ratios: list[list[float]], margin: float = MARGIN) -> int:
    """Index of the candidate to keep, from each one's step ratios over plain per round.

    The first candidate (the predicted fastest) stays unless another was faster
    in every round and its median ratio is lower by more than ``margin``: noise
    alone must not change the plan ``fit`` applies.

    Example:
        >>> pick_fastest([[1.30, 1.32, 1.31], [1.20, 1.21, 1.19]])
        1
    """
    medians = [statistics.median(r) for r in ratios]
    clear = [
        i for i, r in enumerate(ratios)
        if i == 0 or (all(a < b for a, b in zip(r, ratios[0])) and medians[i] < medians[0] - margin)
    ]  # fmt: skip
    return min(clear, key=medians.__getitem__)


def fastest_measured(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    source: Profile | Planner,
    chosen: Plan,
    count: int = 2,
    *,
    rounds: int = 3,
    segments: bool = True,
) -> Plan:
    """Measure up to ``count`` candidate plans (see module doc); return the one to keep.

    ``source``: the profile, or the Planner that made ``chosen`` (see :func:`candidate_plans`).

    Costs ``rounds * (count + 1)`` training steps. The model must not have a plan
    applied; it is left as found (no plan applied, gradients, buffers, RNG).

    Example:
        >>> best = fastest_measured(model, loss_fn, prof, plan, count=2)
        >>> best.predicted_overhead, best.measured_overhead
    """
    if count < 1 or rounds < 1:
        raise ValueError(f"need count >= 1 and rounds >= 1, got {count} and {rounds}")
    planner = _planner(source, segments)
    candidates = candidate_plans(planner, chosen, count)
    clock = work_clock(planner.profile.device)
    guard = StepState(model)  # also leaves and buffers outside the model the step reaches

    def step() -> float:
        guard.reset()
        start = clock()
        loss = loss_fn()
        forward = clock() - start
        guard.adopt_graph(loss)  # untimed: walks the graph
        start = clock()
        loss.backward()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return forward + clock() - start

    ratios: list[list[float]] = [[] for _ in candidates]
    try:
        with guard.watching_modules():
            for _ in range(rounds):
                plain = step()
                for i, candidate in enumerate(candidates):
                    apply(model, candidate)
                    try:
                        ratios[i].append(step() / plain if plain > 0 else 1.0)
                    finally:
                        remove(model)
    finally:
        guard.restore()
    best = pick_fastest(ratios)
    measured = ratios[best]
    return replace(
        candidates[best],
        measured_overhead=statistics.median(measured) - 1.0,
        measured_overhead_range=(min(measured) - 1.0, max(measured) - 1.0),
    )
