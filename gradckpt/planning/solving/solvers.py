"""Solvers: ``(profile, budget_bytes) -> Plan``, all judged by the same simulator.

``dp`` is the reference (the chain dynamic program of :mod:`gradckpt.planning.solving.dp`).
The baselines (:mod:`gradckpt.planning.solving.baselines`) are the schemes frameworks
make users pick by hand: ``none``, ``every_block``, ``every_kth`` (the largest k
that fits), ``sqrt`` (Chen et al.'s sqrt(N) segments) and ``save_matmuls``
(selective checkpointing of every block). Each returns a plan with its
predictions filled in, or raises :class:`BudgetError` when its scheme does not fit.
Every plan leaves through :func:`gradckpt.planning.solve.solve` (above the
decision kinds, so that it can hand an offload link to the offload kind's solver).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from gradckpt.measure.memory import format_bytes
from gradckpt.planning.handlers.engine_counts import EngineCounts
from gradckpt.planning.plans.plan import Item, Plan, Segment, UnitChoice
from gradckpt.planning.simulation.costs import engine_seconds, step_costs
from gradckpt.planning.simulation.simulate import Prediction, simulate
from gradckpt.planning.solving.baselines import (
    every_kth_plan,
    finish,
    fit,
    largest_every_kth,
    none_plan,
    plannable_units,
    save_matmuls_plan,
    sqrt_plan,
)
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.chain import ChainModel, build_chain, with_engine_costs
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.dp_chain import Tree, UnitStep
from gradckpt.planning.solving.polish import polish, repair
from gradckpt.planning.solving.whole_unit import faster_baseline
from gradckpt.profiling.fake import SPEEDS, estimate_time
from gradckpt.profiling.records import Profile

__all__ = [
    "SOLVERS",
    "Solver",
    "alike_in_time",
    "check_plannable",
    "every_kth_plan",
    "finish",
    "least_peak_plan",
    "none_plan",
    "save_matmuls_plan",
    "schedule_plan",
    "solve_dp",
    "sqrt_plan",
    "tie_seconds",
    "without_segments",
]

Solver = Callable[[Profile, int], Plan]
# Budgets (as shares off the real one) at which the DP is asked, largest first:
# its model is exact for uniform plans only, so its answer slightly above the
# budget may still fit on the simulator, and one slightly below may be needed.
_RETRY_SHARES = (-0.05, -0.03, -0.02, -0.01, 0.0, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)

#: What a change to the DP's plan must save, as a share of the plain step's time:
#: a polish move, a whole-unit baseline, and a schedule that holds more memory (of
#: the DP's schedules as fast within it, the leanest is taken). Fresh profiles of one
#: model price near-equal plans a hair either way (the demo GPT under load: a
#: segment of two blocks against recomputing each, -0.1% to +0.33% of the step on
#: the simulator, up to 0.12% on the DP's chain; at 0.1% one of 78 profiles still
#: planned the other, at 0.5% none did).
TIE_SHARE = 0.005


#: How far a plan's predicted time moves from one fresh profile to the next, as a share
#: of each part it is made of. Kernels: the demo GPT's leaner schedule within the tie
#: (its embedding's dropout recomputed too) differed in recomputed kernel time by
#: 0.40-0.61% of the step over 16 profiles under load 4 (median 0.49: about a quarter
#: either way). The engine: its per-event costs read 9-73 us per recomputed op and
#: 0.46-1.10 ms per region over the same profiles, as uncertain as themselves.
KERNEL_NOISE = 0.25
ENGINE_NOISE = 1.0


def alike_in_time(profile: Profile, faster: Prediction, other: Prediction) -> bool:
    """Whether ``other`` is slower than ``faster`` by no more than fresh profiles move the
    difference: its kernels' part by :data:`KERNEL_NOISE`, and every engine event one plan
    has more of than the other by :data:`ENGINE_NOISE` of its price. A difference made of
    recomputed kernels alone is real however small (every profile prices it the same
    way); one where more recompute is bought back by fewer engine events (a segment
    against two regions) can fall either way.

    Example:
        >>> alike_in_time(prof, simulate(prof, plan), simulate(prof, leaner))
    """
    gap = other.step_time - faster.step_time
    kernels = gap - (other.engine_time - faster.engine_time)
    a, b = faster.engine_counts, other.engine_counts
    differing = EngineCounts(
        abs(a.regions - b.regions), abs(a.recompute_ops - b.recompute_ops),
        abs(a.policy_ops - b.policy_ops), abs(a.saved_tensors - b.saved_tensors),
        abs(a.mode_ops - b.mode_ops),
    )  # fmt: skip
    band = KERNEL_NOISE * abs(kernels) + ENGINE_NOISE * engine_seconds(
        differing, step_costs(profile)
    )
    return gap <= band


def tie_seconds(profile: Profile) -> float:
    """What a change to the DP's plan must save to be made: :data:`TIE_SHARE` of the step.

    Example:
        >>> polish(prof, plan, budget, model, tie=tie_seconds(prof))
    """
    return TIE_SHARE * profile.step_time


# Schedules within the tie tried, leanest first (each is one simulation).
_ALIKE_TRIES = 4


def _leanest_alike(
    profile: Profile, model: ChainModel, dp: ChainDP, m: int, budget: int, plan: Plan,
    pred: Prediction,
) -> tuple[Plan, Prediction]:  # fmt: skip
    """Of the DP's schedules as fast as its schedule at ``m`` (``plan``, which fits) within
    the tie, the leanest that peaks lower on the simulator and its time is
    :func:`alike_in_time` (or faster): memory is measured exactly, times are not, so two
    fresh profiles' near-equal plans fall the same way, to the leaner. One that peaks the
    same is no leaner (the DP's memory model is coarser than the simulator), and one slower
    by recomputed kernels beyond their noise is slower on every profile (the demo GPT's
    embedding dropout recomputed too: 0.44-0.64% of the step, the tie's edge, so a fixed
    tie chose it in 4 of 16 profiles): ``plan`` stays, the faster on the DP's prices."""
    for lean in dp.levels_within(m, tie_seconds(profile))[:_ALIKE_TRIES]:
        tree = dp.schedule(lean, tie=0.0)
        candidate = Plan(_items(model, tree), profile.fingerprint, offload=model.offload)
        trial = simulate(profile, candidate)
        leaner = trial.peak_bytes < pred.peak_bytes
        if leaner and (trial.step_time <= pred.step_time or alike_in_time(profile, pred, trial)):
            return candidate, trial
    return plan, pred


def _items(model: ChainModel, tree: Tree) -> tuple[Item, ...]:
    items: list[Item] = []
    for node in tree:
        if isinstance(node, UnitStep):
            items.append(
                UnitChoice(model.units[node.stage].path, model.options[node.stage][node.option])
            )
        else:
            items.append(Segment(_items(model, node.schedule)))
    return tuple(items)


def schedule_plan(profile: Profile, model: ChainModel, dp: ChainDP, m: int) -> Plan:
    """The plan the DP schedules with ``m`` grid units of memory (no predictions yet).

    Example:
        >>> schedule_plan(prof, model, dp, dp.least_feasible())
    """
    return Plan(_items(model, dp.schedule(m)), profile.fingerprint)


def _where(profile: Profile, position: int) -> str:
    ops = profile.ops
    index = next((op.index for op in ops if op.position >= position), len(ops) - 1)
    op = ops[min(index, len(ops) - 1)]
    phase = "backward" if op.backward else "forward"
    unit = profile.units[op.unit].path if op.unit >= 0 else "code outside the planned units"
    return f"the {phase} of {unit}"


def _workspace_note(profile: Profile, pred: Prediction) -> str:
    """Which kernel's workspace is part of the least peak, for a message ("" if none):
    no plan lowers it, short of a smaller batch or another kernel."""
    if pred.peak_workspace_bytes <= 0 or not 0 <= pred.peak_workspace_op < len(profile.ops):
        return ""
    op = profile.ops[pred.peak_workspace_op]
    unit = profile.units[op.unit].path if op.unit >= 0 else "code outside the planned units"
    return (
        f", {format_bytes(pred.peak_workspace_bytes)} of it the workspace of {op.name} "
        f"({'backward' if op.backward else 'forward'} of {unit})"
    )


def least_peak_plan(
    profile: Profile,
    model: ChainModel | None = None,
    dp: ChainDP | None = None,
    *,
    segments: bool = True,
) -> tuple[Plan, Prediction]:
    """The leanest plan the solver reaches, with predictions (its ``peak_bytes`` is the least peak).

    The least of: the DP's plan at its least feasible budget, pushed lower by the
    simulator-checked repair moves (the DP's model is exact only for the plans it
    is calibrated on); the plain plan; and the baselines' plans. So it is never
    above the plain peak or a hand-placed scheme's. Op times do not enter (the
    search runs on times estimated from FLOPs and bytes): profiles of one step
    taken on a busy machine all give the same least peak. ``model`` and ``dp``
    are read only for whether segments are allowed (``without_segments``).

    Example:
        >>> plan, pred = least_peak_plan(prof)
        >>> pred.peak_bytes  # no budget below this is reachable
    """
    if model is not None and not any(st.joins_previous for st in model.chain.stages):
        segments = False
    steady = _timeless(profile)
    chain = build_chain(steady)
    if not segments:
        chain = without_segments(chain)
    candidates = [none_plan(profile), every_kth_plan(profile, 1), save_matmuls_plan(profile)]
    if segments:
        candidates.append(sqrt_plan(profile))
    least_dp = ChainDP(chain.chain)
    m = least_dp.least_feasible()
    if m is not None:
        plan = Plan(_items(chain, least_dp.schedule(m)), profile.fingerprint)
        candidates.insert(0, repair(steady, plan, 0, chain)[0])
    predicted = [(simulate(profile, plan), plan) for plan in candidates]
    pred, best = min(predicted, key=lambda pair: pair[0].peak_bytes)  # the first on ties
    return finish(profile, best, None, "dp", pred)


def _timeless(profile: Profile) -> Profile:
    """``profile`` with each op's time replaced by one estimated from its FLOPs and bytes."""
    speed = SPEEDS.get(profile.device, SPEEDS["cuda"])
    ops = tuple(
        replace(
            op,
            time=estimate_time(
                op.flops,
                sum(profile.storages[s].nbytes for s in op.outputs),
                speed,
                profile.host_op_seconds,
            ),
        )
        for op in profile.ops
    )
    return replace(profile, ops=ops)


def _polished(
    profile: Profile, plan: Plan, pred: Prediction, budget: int, model: ChainModel,
    segments: bool = True,
) -> Plan:  # fmt: skip
    """``plan`` (whose prediction is ``pred``) polished on the simulator, predictions filled
    in; or a whole-unit baseline that simulates faster within the budget (the DP's segment
    model runs low: :mod:`gradckpt.planning.solving.whole_unit`)."""
    tie = tie_seconds(profile)
    polished, polished_pred = polish(profile, plan, budget, model, pred, tie=tie)
    faster = faster_baseline(
        profile, model, polished, polished_pred, budget, segments=segments, tie=tie
    )
    if faster is not None:
        polished, polished_pred = faster
    return finish(profile, polished, budget, "dp", polished_pred)[0]


def without_segments(model: ChainModel) -> ChainModel:
    """The chain with no stage joinable to the one before: the DP then makes no segments.

    A segment recomputes all its units during its last unit's backward; under
    FSDP the other units' parameters are sharded then, so distributed plans
    must not contain segments.
    """
    stages = tuple(replace(st, joins_previous=False) for st in model.chain.stages)
    return replace(model, chain=replace(model.chain, stages=stages))


def solve_dp(profile: Profile, budget: int, *, model: ChainModel | None = None,
             dp: ChainDP | None = None, segments: bool = True) -> Plan:  # fmt: skip
    """The least-recompute plan whose simulated peak fits ``budget`` bytes.

    ``segments=False``: only single-unit regions (no segments), e.g. for FSDP.

    Example:
        >>> plan = solve_dp(prof, 600 << 20)
    """
    model = model or with_engine_costs(build_chain(profile), profile)
    if not segments and any(st.joins_previous for st in model.chain.stages):
        model = without_segments(model)
        dp = None
    dp = dp or ChainDP(model.chain)
    found = dp_search(profile, budget, model, dp, segments)
    if found is not None:
        return found
    leanest, pred = least_peak_plan(profile, segments=segments)
    if pred.peak_bytes <= budget:
        return _polished(profile, leanest, pred, budget, model, segments)
    found = dp_scan(profile, budget, model, dp, segments)
    if found is not None:
        return found
    raise BudgetError(
        f"no plan fits the budget of {format_bytes(budget)}: the least peak gradckpt reaches "
        f"for this step is {_written(pred.peak_bytes)}, of which parameters and buffers "
        f"are {format_bytes(profile.param_bytes)}{_resident(profile)} and the rest "
        f"(activations, gradients and temporaries) peaks during "
        f"{_where(profile, pred.peak_position)}{_workspace_note(profile, pred)}. Raise the "
        "budget, or shrink the batch or sequence length."
        + (f" {profile.blocks_note}" if profile.blocks_note else "")
        + _parents_hint(profile, pred.peak_position),
        least_peak_bytes=pred.peak_bytes,
    )


def dp_search(
    profile: Profile, budget: int, model: ChainModel, dp: ChainDP, segments: bool = True
) -> Plan | None:
    """:func:`solve_dp`'s search on a built chain and DP: the DP's schedules from ``budget``
    down to its least feasible one, then the lowest of them repaired on the simulator; the
    plan that fits, or None (no least-peak fallback, no error).

    Example:
        >>> dp_search(prof, 600 << 20, model, ChainDP(model.chain)) is not None
    """
    top = model.to_units(budget)
    least = dp.least_feasible()
    tried: set[tuple] = set()
    lowest: Plan | None = None
    if least is not None and top >= 0:
        capacity = model.chain.capacity
        for m in [*(top - math.ceil(top * s) for s in _RETRY_SHARES), least]:
            m = min(max(m, least), capacity)
            # tie=0: choices priced within float rounding fall one way, not by the last bit.
            tree = dp.schedule(m, tie=0.0)
            plan = Plan(_items(model, tree), profile.fingerprint, offload=model.offload)
            if plan.items in tried:
                continue
            tried.add(plan.items)
            before, lowest = lowest, plan
            # In this order, not by bisection: at the edge of feasibility the peak is not
            # monotone in the DP's budget, and the first plan that fits is the one wanted.
            pred = simulate(profile, plan)
            if pred.peak_bytes <= budget:
                plan, pred = _leanest_alike(profile, model, dp, m, budget, plan, pred)
                if m == least and before is not None:
                    # The DP's leanest plan buys its last bytes dearly (segments in
                    # segments); the plan before it, repaired, may fit for less time.
                    repaired, fixed = repair(profile, before, budget, model)
                    if fixed.peak_bytes <= budget and fixed.step_time < pred.step_time:
                        plan, pred = repaired, fixed
                return _polished(profile, plan, pred, budget, model, segments)
    # The DP's model is a little off for this plan shape: repair its plans on the simulator.
    if lowest is not None:
        repaired, pred = repair(profile, lowest, budget, model)
        if pred.peak_bytes <= budget:
            return _polished(profile, repaired, pred, budget, model, segments)
    return None


def dp_scan(
    profile: Profile, budget: int, model: ChainModel, dp: ChainDP, segments: bool = True
) -> Plan | None:
    """The fastest DP schedule that fits ``budget`` over the DP's whole range, or None.

    At the edge of feasibility a schedule for a larger DP budget can peak lower than
    the ones :func:`dp_search` tried (the peak is not monotone in it): the whole range
    is scanned, as the frontier does, so no budget a frontier point reaches is refused.

    Example:
        >>> dp_scan(prof, 600 << 20, model, ChainDP(model.chain))
    """
    least = dp.least_feasible()
    if least is None:
        return None
    found = _scanned(profile, model, dp, least, budget)
    return _polished(profile, *found, budget, model, segments) if found is not None else None


def _parents_hint(profile: Profile, position: int) -> str:
    """Where the least peak lies outside every unit and the blocks sit inside repeated
    parents: the parents may be the blocks (their own code then joins a unit)."""
    if not profile.block_parents or "outside the planned units" not in _where(profile, position):
        return ""
    shown = ", ".join(profile.block_parents[:4]) + (
        ", ..." if len(profile.block_parents) > 4 else ""
    )
    return (
        f" The blocks gradckpt found sit inside repeated modules ({shown}) whose own code runs "
        "outside every unit; if those are your model's blocks, pass blocks=[their paths] "
        "(or blocks=lambda path, module: ...) and plan again."
    )


def _resident(profile: Profile) -> str:
    """What the whole training step holds through forward and backward, for a message."""
    if not profile.resident_bytes:
        return ""
    return f", held through the step (optimizer state, resident gradients) {format_bytes(profile.resident_bytes)}"


def _scanned(
    profile: Profile, model: ChainModel, dp: ChainDP, least: int, budget: int, points: int = 32
) -> tuple[Plan, Prediction] | None:
    """The fastest DP schedule that fits ``budget`` among ``points`` spread over the DP's range."""
    top = model.chain.capacity
    best: tuple[Plan, Prediction] | None = None
    for i in range(points):
        m = least + round(i * (top - least) / (points - 1))
        tree = dp.schedule(m, tie=0.0)
        plan = Plan(_items(model, tree), profile.fingerprint, offload=model.offload)
        pred = simulate(profile, plan)
        if pred.peak_bytes <= budget and (best is None or pred.step_time < best[1].step_time):
            best = (plan, pred)
    return best


def _written(nbytes: int) -> str:
    """``nbytes`` for a message: rounded up (so it works as a budget), and exact."""
    return f"{format_bytes(nbytes, round_up=True)} ({nbytes} bytes)"


SOLVERS: dict[str, Solver] = {
    "dp": solve_dp,
    "none": lambda p, b: fit(p, none_plan(p), b, "none"),
    "every_block": lambda p, b: fit(p, every_kth_plan(p, 1), b, "every_block"),
    "every_kth": largest_every_kth,
    "sqrt": lambda p, b: fit(p, sqrt_plan(p), b, "sqrt"),
    "save_matmuls": lambda p, b: fit(p, save_matmuls_plan(p), b, "save_matmuls"),
}


def check_plannable(profile: Profile) -> None:
    """Raise a ValueError saying what to do if ``profile`` has no unit a plan could change.

    Example:
        >>> check_plannable(prof)
    """
    if not plannable_units(profile):
        raise ValueError(
            "gradckpt found nothing to checkpoint in this model: no submodule runs once per "
            "step with ops of its own (units are the model's children and its repeated "
            "blocks). Name the blocks, e.g. gradckpt.plan(model, loss_fn, budget, "
            "blocks=['layers.0', 'layers.1', ...]), or move the forward's layers into "
            "submodules."
        )
