"""Whole-unit baselines priced on the DP's chain, to check the DP's own plan against.

A plan without segments is one DP option per stage, and its simulated step time
is the sum of those options' times plus what the step spends outside them (ops
outside the units, the engine's per-step work): a constant, the same for every
such plan. So the time of the hand-placed whole-unit schemes (``none``, every
k-th block for every k, ``save_matmuls``) is known in O(units) each, with no
simulation. The DP's model of a *segment* is not exact (on measured profiles
it ran about 7% low), so on some profiles the DP's segment plan simulates
slower than one of the baselines at the same budget. :func:`faster_baseline`
finds such a baseline: it prices the whole-unit schemes, and simulates only
those faster than the DP's simulated plan that the chain says fit, fastest
first, until one fits; ``sqrt``, the baseline with segments, is simulated once
per profile. The chain's need is exact for the uniform plans it is calibrated
on and close for mixed ones, so a mixed scheme the chain says does not fit is
not tried.

Example:
    >>> better = faster_baseline(prof, model, plan, simulate(prof, plan), budget)
    >>> better is None  # the DP's plan is at least as fast as every such scheme that fits
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import replace

from gradckpt.engine.decisions import KEEP, RECOMPUTE, Decision
from gradckpt.planning.plans.plan import Plan, UnitChoice
from gradckpt.planning.simulation.costs import engine_seconds, plan_counts, step_costs
from gradckpt.planning.simulation.per_profile import per_profile
from gradckpt.planning.simulation.simulate import Prediction, simulate
from gradckpt.planning.solving.baselines import (
    none_plan,
    plannable_units,
    save_matmuls_plan,
    sqrt_plan,
)
from gradckpt.planning.solving.chain import ChainModel
from gradckpt.planning.solving.dp_chain import ceil_div
from gradckpt.profiling.records import Profile

__all__ = ["chain_need", "chain_time", "faster_baseline", "stage_picks"]


def stage_picks(model: ChainModel, decisions: list[Decision]) -> tuple[int, ...] | None:
    """The DP option index of each stage's decision (None: one is not among its options).

    Example:
        >>> stage_picks(model, [KEEP] * len(model.units))  # every stage kept
    """
    picks = []
    for options, decision in zip(model.options, decisions, strict=True):
        if decision not in options:
            return None
        picks.append(options.index(decision))
    return tuple(picks)


def chain_time(model: ChainModel, picks: tuple[int, ...]) -> float:
    """Seconds the chain's options take for a whole-unit plan (the DP's objective)."""
    return sum(st.options[k].time for st, k in zip(model.chain.stages, picks))


def chain_need(model: ChainModel, picks: tuple[int, ...]) -> int:
    """Grid units the DP's top-level table needs to run a whole-unit plan.

    As the table is filled (:mod:`gradckpt.planning.solving.dp_cells`), stage ``a`` needs
    its own forward and backward requirement (with the gradients of the stages
    after it) on top of what the stages before it keep plus their outputs: the
    need is the largest such sum.

    Example:
        >>> chain_need(model, picks) <= model.to_units(budget)  # the chain says it fits
    """
    own, step = _need_tables(model)
    before = itertools.accumulate((step[a][k] for a, k in enumerate(picks)), initial=0)
    return max(map(operator.add, (own[a][k] for a, k in enumerate(picks)), before))


def _need_tables(model: ChainModel) -> tuple[list[list[int]], list[list[int]]]:
    """Per stage and option: its own need (grid units), and what it keeps plus the next
    stage's input."""
    cached = _NEED_TABLES.get(id(model))
    if cached is not None and cached[0] is model:
        return cached[1]
    stages, scale = model.chain.stages, model.chain.scale
    own: list[list[int]] = [[] for _ in stages]
    step: list[list[int]] = [[] for _ in stages]
    grads_after = 0
    for a in range(len(stages) - 1, -1, -1):
        after = stages[a + 1].input if a + 1 < len(stages) else 0
        for option in stages[a].options:
            own[a].append(ceil_div(max(option.fwd, option.bwd + grads_after), scale))
            step[a].append(option.kept + after)
        grads_after += stages[a].grad
    _NEED_TABLES.clear()  # one model at a time: the solver works through one
    _NEED_TABLES[id(model)] = (model, (own, step))
    return own, step


_NEED_TABLES: dict[int, tuple[ChainModel, tuple[list[list[int]], list[list[int]]]]] = {}


def _schemes(profile: Profile, model: ChainModel) -> list[tuple[float, tuple[int, ...], Plan | None]]:
    """(chain time, stage picks, plan or None: built when simulated) of every whole-unit
    baseline, in O(units log units) for the every_kth ones (each differs from keeping
    everything in units/k stages)."""
    units = model.units
    keep = stage_picks(model, [KEEP] * len(units))
    if keep is None or tuple(u.path for u in plannable_units(profile)) != tuple(
        u.path for u in units
    ):
        return []
    stages = model.chain.stages
    kept_time = chain_time(model, keep)
    schemes: list[tuple[float, tuple[int, ...], Plan | None]] = []
    for plan in (none_plan(profile), save_matmuls_plan(profile)):
        picks = stage_picks(model, [item.decision for item in plan.items])
        if picks is not None:
            schemes.append((chain_time(model, picks), picks, plan))
    blocks = [i for i, u in enumerate(units) if u.is_block]
    if any(RECOMPUTE not in model.options[i] for i in blocks):
        return schemes
    recompute = {i: model.options[i].index(RECOMPUTE) for i in blocks}
    extra = {i: stages[i].options[recompute[i]].time - stages[i].options[keep[i]].time for i in blocks}
    for k in range(1, len(blocks) + 1):  # every k-th block: the every_kth baseline's plans
        chosen = blocks[::k]
        picks = list(keep)
        for i in chosen:
            picks[i] = recompute[i]
        schemes.append((kept_time + sum(extra[i] for i in chosen), tuple(picks), None))
        if len(chosen) == 1:
            break  # every larger k recomputes the first block alone too
    return schemes


@per_profile
def _sqrt(profile: Profile) -> tuple[Plan, Prediction]:
    # The one baseline with segments, which the chain cannot price exactly: simulated
    # once per profile (the solver is asked at many budgets of one profile).
    plan = sqrt_plan(profile)
    return plan, simulate(profile, plan)


def faster_baseline(
    profile: Profile,
    model: ChainModel,
    plan: Plan,
    pred: Prediction,
    budget: int,
    *,
    segments: bool = True,
    tie: float = 0.0,
) -> tuple[Plan, Prediction] | None:
    """The fastest baseline that simulates faster than ``plan`` (whose prediction is
    ``pred``) by more than ``tie`` seconds within ``budget``, with its prediction; None
    if there is none.

    Whole-unit schemes are simulated only if priced below ``pred.step_time`` with a
    chain need that fits the budget, fastest first, until one fits on the
    simulator. ``segments``: the ``sqrt`` scheme is a candidate too (simulated once
    per profile).

    Example:
        >>> faster_baseline(prof, model, plan, pred, 600 << 20)
    """
    found: tuple[Plan, Prediction] | None = None
    if segments and any(st.joins_previous for st in model.chain.stages):
        sqrt, sqrt_pred = _sqrt(profile)
        if sqrt_pred.peak_bytes <= budget and sqrt_pred.step_time < pred.step_time - tie:
            found = replace(sqrt, offload=model.offload), sqrt_pred
    best = found[1].step_time if found else pred.step_time - tie
    keep = stage_picks(model, [KEEP] * len(model.units))
    schemes = _schemes(profile, model)
    if keep is None or not schemes:
        return found
    # What every whole-unit plan spends outside its options: the plain step's time
    # (with its engine work) less its options' (every stage kept).
    plain = profile.step_time + engine_seconds(plan_counts(profile, [], []), step_costs(profile))
    outside = plain - chain_time(model, keep)
    top = model.to_units(budget)
    for time, picks, plan_or_none in sorted(schemes, key=lambda s: s[0]):
        if outside + time >= best:
            break
        if chain_need(model, picks) > top:
            continue
        candidate = plan_or_none or Plan(
            tuple(UnitChoice(u.path, o[k]) for u, o, k in zip(model.units, model.options, picks)),
            profile.fingerprint,
        )
        trial = simulate(profile, candidate)
        if trial.peak_bytes <= budget and trial.step_time < best:
            return replace(candidate, offload=model.offload), trial
    return found
