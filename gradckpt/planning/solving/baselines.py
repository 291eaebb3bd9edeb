"""The hand-placed baselines, and ``finish``: every solver's plan gets its predictions there.

The baselines are the schemes frameworks make users pick by hand: ``none``,
``every_block``, ``every_kth`` (the largest k that fits), ``sqrt`` (Chen et
al.'s sqrt(N) segments) and ``save_matmuls`` (selective checkpointing of every
block). Each ``*_plan`` builds its plan in one pass over the units; the solvers
in :data:`gradckpt.planning.solving.solvers.SOLVERS` fill in its predictions and raise
:class:`BudgetError` when it does not fit.

Example:
    >>> plan, pred = finish(prof, every_kth_plan(prof, 2), None, "every_kth(k=2)")
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from gradckpt.engine.decisions import KEEP, RECOMPUTE, Selective
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.plans.plan import Item, Plan, Segment, UnitChoice
from gradckpt.planning.simulation.simulate import Prediction, simulate
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.step_phases import step_parts
from gradckpt.policies import MATMUL_OPS
from gradckpt.profiling.records import Profile, UnitRecord

__all__ = [
    "every_kth_plan",
    "finish",
    "fit",
    "largest_every_kth",
    "none_plan",
    "plannable_units",
    "save_matmuls_plan",
    "sqrt_plan",
]

_MATMUL_NAMES = {str(op) for op in MATMUL_OPS}  # save_matmuls keeps these ops' outputs


def finish(
    profile: Profile, plan: Plan, budget: int | None, solver: str, pred: Prediction | None = None
) -> tuple[Plan, Prediction]:
    """Fill in a plan's predictions from the simulator (``pred``: already simulated).

    Example:
        >>> plan, pred = finish(prof, none_plan(prof), None, "none")
    """
    pred = pred or simulate(profile, plan)
    return (
        replace(
            plan,
            budget_bytes=budget,
            predicted_peak_bytes=pred.peak_bytes,
            baseline_peak_bytes=profile.measured_peak_bytes,
            predicted_step_time=pred.step_time,
            baseline_step_time=profile.step_time,
            predicted_recompute_flops=pred.recompute_flops,
            solver=solver,
            input_shapes=profile.input_shapes,
            # Only a profile from before units were per call has such units (see UnitRecord).
            not_planned=tuple(
                (u.path, u.calls) for u in profile.units if u.calls > 1 and not u.plannable
            ),
            peak_level=profile.peak_level,
            step=step_parts(profile, pred),
            host_op_seconds=profile.host_op_seconds or None,
        ),
        pred,
    )


def plannable_units(profile: Profile) -> tuple[UnitRecord, ...]:
    """The units a plan may decide for, in forward order (a plan's items, one each)."""
    return tuple(u for u in profile.units if u.plannable)


def _uniform(profile: Profile, choose: Callable[[UnitRecord, int], UnitChoice]) -> Plan:
    blocks = [u for u in plannable_units(profile) if u.is_block]
    order = {u.index: i for i, u in enumerate(blocks)}
    items = tuple(
        choose(u, order[u.index]) if u.is_block else UnitChoice(u.path)
        for u in plannable_units(profile)
    )
    return Plan(items, profile.fingerprint)


def fit(profile: Profile, plan: Plan, budget: int, name: str) -> Plan:
    """``plan`` with its predictions, as the ``name`` scheme; BudgetError if it does not fit.

    Example:
        >>> fit(prof, every_kth_plan(prof, 1), 600 << 20, "every_block").predicted_peak_bytes
    """
    plan, pred = finish(profile, plan, budget, name)
    if pred.peak_bytes > budget:
        raise BudgetError(
            f"the {name} scheme peaks at {format_bytes(pred.peak_bytes)}, over the budget of "
            f"{format_bytes(budget)}",
            least_peak_bytes=pred.peak_bytes,
        )
    return plan


def none_plan(profile: Profile) -> Plan:
    """Every unit kept: the plain step.

    Example:
        >>> simulate(prof, none_plan(prof)).peak_bytes
    """
    return Plan(tuple(UnitChoice(u.path) for u in plannable_units(profile)), profile.fingerprint)


def every_kth_plan(profile: Profile, k: int) -> Plan:
    """Blocks 0, k, 2k, ... recomputed, every other unit kept (k=1: every block).

    Example:
        >>> every_kth_plan(prof, 2).items[1].decision
    """
    return _uniform(profile, lambda u, i: UnitChoice(u.path, RECOMPUTE if i % k == 0 else KEEP))


def save_matmuls_plan(profile: Profile) -> Plan:
    """Every block a selective region keeping its matmuls' outputs (recompute if it has none).

    Example:
        >>> save_matmuls_plan(prof).items[1].decision.kind
        'selective'
    """

    def choose(u: UnitRecord, i: int) -> UnitChoice:
        ops = [
            op for op in profile.unit_ops(u)
            if op.name in _MATMUL_NAMES and op.outputs
            and not any(profile.storages[s].mutated for s in op.outputs)
        ]  # fmt: skip
        if not ops:
            return UnitChoice(u.path, RECOMPUTE)
        return UnitChoice(
            u.path, Selective(tuple(op.local for op in ops), tuple(op.name for op in ops))
        )

    return _uniform(profile, choose)


def sqrt_plan(profile: Profile) -> Plan:
    """Chen et al.: segments of about sqrt(N) chained blocks that keep only their input."""
    units = plannable_units(profile)
    blocks = [u for u in units if u.is_block]
    size = max(2, round(math.sqrt(len(blocks))))
    items: list[Item] = []
    run: list[UnitRecord] = []

    def flush() -> None:
        while run:
            part, run[:] = run[:size], run[size:]
            if len(part) >= 2:
                items.append(Segment(tuple(UnitChoice(u.path) for u in part)))
            else:
                items.append(UnitChoice(part[0].path, RECOMPUTE))

    for u in units:
        joins = run and u.is_block and u.chained and run[-1].index == u.index - 1
        if u.is_block and (joins or not run):
            run.append(u)
            continue
        flush()
        if u.is_block:
            run.append(u)
        else:
            items.append(UnitChoice(u.path))
    flush()
    return Plan(tuple(items), profile.fingerprint)


def largest_every_kth(profile: Profile, budget: int) -> Plan:
    """Checkpoint every k-th block, for the largest k whose plan fits ``budget`` (the
    ``every_kth`` solver).

    Example:
        >>> largest_every_kth(prof, 600 << 20).solver
        'every_kth(k=2)'
    """
    blocks = [u for u in plannable_units(profile) if u.is_block]
    for k in range(max(1, len(blocks)), 0, -1):
        try:
            return fit(profile, every_kth_plan(profile, k), budget, f"every_kth(k={k})")
        except BudgetError:
            continue
    raise BudgetError(f"checkpointing every k-th block does not fit {format_bytes(budget)}")
