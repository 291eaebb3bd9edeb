"""Plans made from fake tensors, checked on real steps that fit: the plain step never runs.

When the plain step may not fit the budget (:mod:`gradckpt.api_budget`), the
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

import torch
from torch import nn

from gradckpt.apply.apply import apply, remove
from gradckpt.apply.measured_step import measured_step, model_device, timed_step
from gradckpt.apply.select import candidate_plans, pick_fastest
from gradckpt.measure.memory import format_bytes
from gradckpt.measure.timing import work_clock
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.profiling import adapters
from gradckpt.profiling.records import Profile
from gradckpt.profiling.state import StepState

__all__ = ["TRIES", "frugal_measured"]

#: Plans made again tighter after a measured miss, at most.
TRIES = 3


class _Runner:
    """Runs the step under a plan; each step starts from the state the model was found in."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[], torch.Tensor], raw: Profile) -> None:
        self.model, self.loss_fn, self.raw = model, loss_fn, raw
        self.guard = StepState(model)
        self.clock = work_clock(raw.device)
        self.device = model_device(model)

    def run(self, plan: Plan, measure: bool) -> tuple[float, int | None]:
        """(step seconds, bytes the allocator held beyond the fake prediction or None)."""
        apply(self.model, plan)
        try:
            if not measure:
                return timed_step(self.guard, self.loss_fn, self.device, self.clock), None
            reading = measured_step(self.guard, self.loss_fn, self.device, self.clock)
        finally:
            remove(self.model)
        # Autograd's graph and Python objects too: a budget counted at malloc's level holds them.
        measured = self.raw.param_bytes + reading.peak_bytes + reading.beside_bytes
        # On CUDA an out-of-memory error sees what the caching allocator reserved.
        measured = max(measured, reading.reserved_high_water_bytes or 0)
        return reading.seconds, measured - simulate(self.raw, plan).fwd_bwd_peak_bytes


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
) -> Plan:
    """The plan to keep, checked on real steps (see the module docstring).

    ``planner`` plans from the whole-step fake profile; ``raw`` is the fake profile
    before the training step was folded in (what one measured step is compared with).

    Raises:
        BudgetError: even the leanest plan measured over the budget.
    """
    runner = _Runner(model, loss_fn, raw)
    try:
        # As profiled (transformers: no KV cache), so the steps compare with the profile.
        with adapters.preparing(model), runner.guard.watching_modules():
            return _checked(runner, planner, chosen, budget, max(1, count), rounds, solver)
    finally:
        runner.guard.restore()


def _checked(
    runner: _Runner, planner: Planner, chosen: Plan, budget: int, count: int, rounds: int,
    solver: object,
) -> Plan:  # fmt: skip
    leanest, _ = planner.least_peak()
    candidates = candidate_plans(planner, chosen, count)
    planner.release()  # its DP tables are CPU memory: not held while steps run
    _, missed = runner.run(leanest, measure=True)
    missed = max(0, missed or 0)
    if _whole(planner, leanest, missed) > budget:
        least = _whole(planner, leanest, missed)
        raise BudgetError(
            f"the leanest plan measured {format_bytes(least)} for the whole step on a real "
            f"step ({format_bytes(missed)} more than predicted: memory the kernels and "
            f"autograd took that the profile did not show), over the budget of "
            f"{format_bytes(budget)}; a budget of {format_bytes(least, round_up=True)} holds "
            "it, or shrink the batch",
            least_peak_bytes=least,
        )
    for _ in range(TRIES):
        if _whole(planner, chosen, missed) <= budget:
            break
        chosen = _with_budget(planner.plan(budget - missed, solver), budget)  # type: ignore[arg-type]
        candidates = candidate_plans(planner, chosen, count)
        planner.release()
    times: list[list[float]] = [[] for _ in candidates]
    over: set[int] = set()
    for r in range(rounds):
        for i, candidate in enumerate(candidates):
            if i in over:
                continue
            if _whole(planner, candidate, missed) > budget:  # never run one predicted over
                over.add(i)
                continue
            seconds, extra = runner.run(candidate, measure=r == 0)
            if extra is not None:
                missed = max(missed, extra)  # the next candidates are predicted with it
                if _whole(planner, candidate, extra) > budget:
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


def _with_budget(plan: Plan, budget: int) -> Plan:
    return replace(plan, budget_bytes=budget)


def _measured(planner: Planner, plan: Plan, budget: int, missed: int) -> Plan:
    """``plan`` with its peak predicted at the allocator: the fake prediction plus what the
    real steps held beyond it."""
    return replace(plan, budget_bytes=budget, predicted_peak_bytes=_whole(planner, plan, missed),
                   peak_level="allocator")  # fmt: skip
