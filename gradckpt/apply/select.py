"""Close the loop: run the most promising plans for a few real steps, keep the fastest.

The planner ranks plans by predicted time, and a prediction can be wrong by
more than the gap between two plans that fit (the engine's Python per op,
allocator work, ops running colder in a recompute than when profiled), and
by more for some kinds of plan than for others (selective units have been
priced too cheap, whole units and segments well). So ``fit`` takes the few
candidates that fit the budget: the DP's plan, then the best plan of each
other *kind* (:func:`plan_kind`: whole-unit, each unit kept or recomputed
whole as per-layer checkpointing does, first; then selective and segment
plans, fastest predicted first), so the pick is never a plan whose kind was
priced wrong while a plan of another kind that would have won went unmeasured;
then the baselines and leaner DP plans predicted fastest. It runs each for
``rounds`` real steps interleaved with the plain step (plain, A, B, plain, A,
B, ...), and keeps the one whose median step ratio is lowest. The kept plan
records its predicted and measured overhead; what was measured is logged at
INFO on the ``"gradckpt"`` logger.

Cost: ``rounds * (candidates + 1)`` training steps (12 with ``fit``'s
defaults: three candidates, one per kind), plus one ``apply``/``remove`` per
candidate step. Baselines and leaner DP plans predicted no faster and no
leaner than the planner's choice are not candidates (each runs real steps, and
such a plan only risks the budget). The model, its gradients, buffers and the
RNG are left as found.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from gradckpt.apply.apply import apply, remove
from gradckpt.engine.decisions import Keep, Offload, Recompute, Selective
from gradckpt.measure.timing import work_clock
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import Plan, Segment, UnitChoice, iter_units
from gradckpt.planning.solve import solve
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.chain import ChainModel
from gradckpt.planning.solving.solvers import finish, solve_dp
from gradckpt.profiling.records import Profile
from gradckpt.profiling.state import StepState

__all__ = [
    "KINDS",
    "best_of_each_kind",
    "candidate_plans",
    "fastest_measured",
    "pick_fastest",
    "plan_kind",
    "whole_unit_plan",
]

logger = logging.getLogger("gradckpt")

#: The kinds of plan :func:`plan_kind` tells apart.
KINDS = ("whole-unit", "selective", "segment", "offload")

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


def _whole_units(model: ChainModel, *, segments: bool = False) -> ChainModel:
    """The DP chain with each unit's selective options removed; segments only if ``segments``
    (and the chain allowed them)."""
    picks = [[i for i, o in enumerate(opts) if type(o) in _WHOLE] for opts in model.options]
    stages = tuple(
        replace(
            stage,
            options=tuple(stage.options[i] for i in pick),
            joins_previous=segments and stage.joins_previous,
        )
        for stage, pick in zip(model.chain.stages, picks)
    )
    options = tuple(tuple(opts[i] for i in pick) for opts, pick in zip(model.options, picks))
    return replace(model, chain=replace(model.chain, stages=stages), options=options)


def _whole(items: tuple) -> bool:
    return all(isinstance(i, UnitChoice) and type(i.decision) in _WHOLE for i in items)


def plan_kind(plan: Plan) -> str:
    """What kind of plan this is, one of :data:`KINDS`.

    ``"segment"``: a region spans several units; else ``"selective"``: a unit
    keeps some of its ops' outputs; else ``"offload"``: a unit's saved tensors
    move to the host; else ``"whole-unit"``: every unit kept or recomputed whole.

    Example:
        >>> plan_kind(gradckpt.plan(model, loss_fn, 0.5, profile=prof))
        'selective'
    """
    if any(isinstance(i, Segment) for i in plan.items):
        return "segment"
    decisions = [type(u.decision) for u in iter_units(plan.items)]
    if Selective in decisions:
        return "selective"
    return "offload" if Offload in decisions else "whole-unit"


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


def _solved(planner: Planner, budget: int, model: ChainModel | None, segments: bool) -> Plan | None:
    """The DP's plan over ``model`` (None: the planner's own), or None when none fits."""
    try:
        if model is None:
            return planner.plan(budget)
        return solve_dp(planner.profile, budget, model=model, segments=segments)
    except BudgetError:
        return None


def best_of_each_kind(
    source: Profile | Planner, budget: int, *, segments: bool = True
) -> dict[str, Plan]:
    """The least-time plan within ``budget`` of each kind that fits (:func:`plan_kind`).

    Each comes from the DP over a restricted chain: all options (its plan counts
    for its own kind), every option but segments (the best selective plan),
    whole units with segments (the best segment plan), whole units alone
    (:func:`whole_unit_plan`). A kind no plan of which fits is absent. A few DP
    solves on the planner's chain, cheap next to one training step.

    Example:
        >>> {k: f"{p.predicted_overhead:+.1%}" for k, p in best_of_each_kind(prof, budget).items()}
        {'selective': '+24.4%', 'segment': '+28.2%', 'whole-unit': '+35.1%'}
    """
    planner = _planner(source, segments)
    found = [
        _solved(planner, budget, None, planner.segments),
        _solved(planner, budget, planner.chain, segments=False),
        whole_unit_plan(planner, budget),
    ]
    if planner.segments:
        whole_with_segments = _whole_units(planner.chain, segments=True)
        found.append(_solved(planner, budget, whole_with_segments, segments=True))
    best: dict[str, Plan] = {}
    for plan in found:
        if plan is None or plan.predicted_peak_bytes > budget:
            continue
        kind = plan_kind(plan)
        if kind not in best or plan.predicted_step_time < best[kind].predicted_step_time:
            best[kind] = plan
    return best


def candidate_plans(
    source: Profile | Planner, chosen: Plan, count: int, *, segments: bool = True
) -> list[Plan]:
    """``chosen`` and up to ``count - 1`` other plans that fit its budget.

    Next come the best plans of the kinds ``chosen`` is not
    (:func:`best_of_each_kind`): the whole-unit one first whenever it fits and
    differs from ``chosen``, then the others fastest predicted first; the
    baselines and leaner DP plans fill what is left, fastest predicted first.

    ``source``: the profile, or the :class:`~gradckpt.planning.planner.Planner` that
    made ``chosen`` (its chain and DP are then reused; ``segments`` is its own).

    Example:
        >>> found = candidate_plans(prof, gradckpt.plan(model, loss_fn, 0.5, profile=prof), 3)
        >>> [plan_kind(p) for p in found]
        ['selective', 'whole-unit', 'segment']
    """
    budget = chosen.budget_bytes
    if budget is None or count <= 1:
        return [chosen]
    planner = _planner(source, segments)
    kind = plan_kind(chosen)
    others = [p for k, p in best_of_each_kind(planner, budget).items() if k != kind]
    others.sort(key=lambda p: (plan_kind(p) != "whole-unit", p.predicted_step_time))
    unique: dict[tuple, Plan] = {chosen.items: chosen}
    first = [chosen]
    for plan in others:
        if plan.items not in unique:
            unique[plan.items] = plan
            first.append(plan)
    if len(first) < count:
        for plan in _other_plans(planner, budget):
            # A filler no faster and no leaner than the planner's choice adds nothing to
            # measure (a U-Net's save-matmuls plan: 18% over its plain peak, and slower).
            if not _dominated(plan, chosen):
                unique.setdefault(plan.items, plan)
    rest = sorted(
        (p for p in unique.values() if all(p is not f for f in first)),
        key=lambda p: p.predicted_step_time,
    )
    return [*first, *rest][:count]


def _dominated(plan: Plan, by: Plan) -> bool:
    return (
        plan.predicted_peak_bytes >= by.predicted_peak_bytes
        and plan.predicted_step_time >= by.predicted_step_time
    )


def _other_plans(planner: Planner, budget: int) -> list[Plan]:
    """The baselines and leaner DP plans that fit ``budget``."""
    profile = planner.profile
    found: list[Plan] = []
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
    return found


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
    logger.info(
        "gradckpt: measured %d candidate plan(s) over %d step(s) each: %s; kept the %s plan",
        len(candidates), rounds,
        ", ".join(f"{plan_kind(c)} {statistics.median(r) - 1:+.1%} (predicted "
                  f"{c.predicted_overhead:+.1%})" for c, r in zip(candidates, ratios)),
        plan_kind(candidates[best]),
    )  # fmt: skip
    return replace(
        candidates[best],
        measured_overhead=statistics.median(measured) - 1.0,
        measured_overhead_range=(min(measured) - 1.0, max(measured) - 1.0),
    )
