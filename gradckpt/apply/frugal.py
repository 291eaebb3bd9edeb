"""Plans made from fake tensors, checked on real steps that fit: the plain step never runs.

When the plain step may not fit the budget (:mod:`gradckpt.api.budget`), the
plan comes from a fake profile, which counts no kernel workspace and times ops
from FLOPs and bytes. This module checks it on the model, running only plans
predicted to fit, the leanest first:

1. the leanest plan runs one step under :class:`~gradckpt.measure.AllocatorTracker`;
   what the allocator held beyond the fake prediction (workspace, rounding; on
   CUDA, the caching allocator's reserved high-water when it is higher) is
   added to every prediction. If the chosen plan then misses the budget, it is
   planned again that much tighter (at most :data:`TRIES` times);
2. the chosen plan and up to ``count - 1`` other candidates
   (:func:`gradckpt.apply.select.candidate_plans`) run ``rounds`` steps each,
   interleaved, their first step measured at the allocator; one measured over
   the budget is dropped, and the fastest median step is kept
   (:func:`~gradckpt.apply.select.pick_fastest`, times relative to the first).

The kept plan's ``measured_overhead`` stays None: the plain step never ran, so
there is nothing to measure it against. Costs ``1 + rounds * count`` steps.
The model, its gradients, buffers and the RNG are left as found.

Example:
    >>> plan = frugal_measured(model, loss_fn, planner, raw_fake_profile, plan, budget)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

from gradckpt.apply.apply import apply
from gradckpt.apply.measured_step import PlanSteps
from gradckpt.apply.select import candidate_plans, pick_fastest
from gradckpt.measure.beside import warn_tensors_only
from gradckpt.measure.memory import format_bytes
from gradckpt.measure.timing import work_clock
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.profiling.records import Profile

__all__ = ["TRIES", "frugal_measured"]

#: Plans made again tighter after a measured miss, at most.
TRIES = 3


class _Runner:
    """Runs the step under a plan; each step starts from the state the model was found in."""

    def __init__(
        self, model: nn.Module, loss_fn: Callable[[], torch.Tensor], raw: Profile,
        since: int | None = None, at_malloc: bool = True,
    ) -> None:  # fmt: skip
        self.raw = raw
        self.at_malloc = at_malloc
        self.steps = PlanSteps(
            model, loss_fn, install=apply, clock=work_clock(raw.device), beside_since=since
        )

    def run(self, plan: Plan, measure: bool) -> tuple[float, Excess | None]:
        """(step seconds, what the step held beyond the fake prediction, or None unmeasured)."""
        seconds, reading = self.steps.run(plan, measure)
        if reading is None:
            return seconds, None
        measured = self.raw.param_bytes + reading.peak_bytes
        # On CUDA an out-of-memory error sees what the caching allocator reserved.
        measured = max(measured, reading.reserved_high_water_bytes or 0)
        allocator = measured - simulate(self.raw, plan).fwd_bwd_peak_bytes
        return seconds, Excess(allocator, reading.beside_bytes if self.at_malloc else 0)


class Excess(NamedTuple):
    """What a real step held beyond a plan's fake prediction: at the allocator (kernel
    workspace no op's run showed, rounding), and beside the allocator's blocks at malloc's
    level (autograd's graph, Python objects, planning's own, the tracker's records). A
    budget holds both; a plan's predicted peak stays at the allocator.
    """

    allocator: int = 0
    beside: int = 0

    def most(self, other: Excess) -> Excess:
        return Excess(max(self.allocator, other.allocator), max(self.beside, other.beside))


def frugal_measured(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    planner: Planner,
    raw: Profile,
    chosen: Plan,
    budget: int,
    count: int = 2,
    *,
    rounds: int = 3,
    solver: object = "dp",
    since: int | None = None,
    at_malloc: bool = True,
) -> Plan:
    """The plan to keep, checked on real steps (see the module docstring).

    ``planner`` plans from the whole-step fake profile; ``raw`` is the fake profile
    before the training step was folded in (what one measured step is compared with).
    ``since``: malloc's bytes in use when planning began
    (:func:`~gradckpt.measure.beside.malloc_in_use`): what planning holds while the
    steps run (profiles, plans) is counted against the budget with them.
    ``at_malloc=False``: what the steps hold beside the allocator is not counted
    (offload: on the CPU, its host memory is malloc's too).

    Raises:
        BudgetError: even the leanest plan measured over the budget.
    """
    runner = _Runner(model, loss_fn, raw, since, at_malloc)
    # As profiled (transformers: no KV cache), so the steps compare with the profile.
    with runner.steps:
        return _checked(runner, planner, chosen, budget, max(1, count), rounds, solver)


def _checked(
    runner: _Runner, planner: Planner, chosen: Plan, budget: int, count: int, rounds: int,
    solver: object,
) -> Plan:  # fmt: skip
    leanest, _ = planner.least_peak()
    candidates = candidate_plans(planner, chosen, count)
    planner.release()  # its DP tables are CPU memory: not held while steps run
    _, seen = runner.run(leanest, measure=True)
    missed = Excess().most(seen or Excess())
    tensors_only = missed._replace(beside=0)
    with_beside = _held(planner, leanest, missed)
    if with_beside > budget >= _held(planner, leanest, tensors_only):
        # The budget holds the tensors at the allocator, as a GPU counts them, and no room
        # for what malloc holds beside them: planned for the tensors, and said.
        warn_tensors_only(budget, with_beside, stacklevel=5)
        runner.at_malloc, missed = False, tensors_only
    if _held(planner, leanest, missed) > budget:
        least = _held(planner, leanest, missed)
        raise BudgetError(
            f"the leanest plan measured {format_bytes(least)} for the whole step on a real "
            f"step ({format_bytes(least - _whole(planner, leanest, 0))} more than predicted: "
            f"memory the kernels, autograd and planning took that the profile did not show), "
            f"over the budget of {format_bytes(budget)}; a budget of "
            f"{format_bytes(least, round_up=True)} holds it, or shrink the batch",
            least_peak_bytes=least,
        )
    for _ in range(TRIES):
        if _held(planner, chosen, missed) <= budget:
            break
        target = budget - missed.allocator - missed.beside
        chosen = _with_budget(planner.plan(target, solver), budget)  # type: ignore[arg-type]
        candidates = candidate_plans(planner, chosen, count)
        planner.release()
    times: list[list[float]] = [[] for _ in candidates]
    over: set[int] = set()
    for r in range(rounds):
        for i, candidate in enumerate(candidates):
            if i in over:
                continue
            if _held(planner, candidate, missed) > budget:  # never run one predicted over
                over.add(i)
                continue
            seconds, seen = runner.run(candidate, measure=r == 0)
            if seen is not None:
                missed = missed.most(seen)  # the next candidates are predicted with it
                if _held(planner, candidate, seen) > budget:
                    over.add(i)
                    continue
            times[i].append(seconds)
    kept = [i for i in range(len(candidates)) if i not in over and times[i]]
    if not kept:
        return _measured(planner, leanest, budget, missed)
    first = statistics.median(times[kept[0]])
    ratios = [[t / first for t in times[i]] for i in kept]
    return _measured(planner, candidates[kept[pick_fastest(ratios)]], budget, missed)


def _whole(planner: Planner, plan: Plan, extra: int) -> int:
    """The whole-step peak of ``plan`` with the bytes its real step held beyond fake tensors."""
    pred = simulate(planner.profile, plan)
    return max(pred.fwd_bwd_peak_bytes + extra, planner.profile.floor_bytes)


def _held(planner: Planner, plan: Plan, excess: Excess) -> int:
    """What the budget holds for ``plan``'s step: its allocator peak and what is beside it."""
    return _whole(planner, plan, excess.allocator) + excess.beside


def _with_budget(plan: Plan, budget: int) -> Plan:
    return replace(plan, budget_bytes=budget)


def _measured(planner: Planner, plan: Plan, budget: int, missed: Excess) -> Plan:
    """``plan`` with its peak predicted at the allocator: the fake prediction plus what the
    real steps held beyond it there."""
    peak = _whole(planner, plan, missed.allocator)
    return replace(plan, budget_bytes=budget, predicted_peak_bytes=peak, peak_level="allocator")
