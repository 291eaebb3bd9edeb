"""One real step at a new shape under a given plan, measured at the allocator.

What the re-planner (:class:`gradckpt.api.shape_planner.ShapePlanner`) falls back on when a
shape cannot be profiled under fake tensors (MoE kernels whose fake version is
stricter than the real one, a loss that calls ``nonzero()``, a branch on a
value): the step at that shape runs once under the leanest plan known, inside
:class:`~gradckpt.measure.AllocatorTracker`, and the plan is kept if what the
allocator held fits the budget. Like :mod:`gradckpt.apply.frugal`, the step
starts from and leaves the model's gradients, buffers and RNG as found, so the
user's own step that follows is the one a plain model would run.

It also verifies plans made from fake profiles for models whose fitted profile
showed memory fake tensors cannot see (:func:`unseen_share`: convolution
workspace, allocator rounding): :func:`verified_at_shape` runs the step once
under the fake-chosen plan, made for the budget less that share, and re-solves
with the budget lowered by what the allocator held beyond it until one fits.

Example:
    >>> plan = measured_at_shape(model, step, leanest, budget_bytes, fitted_profile)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from gradckpt.apply.measured_step import PlanSteps
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.solvers import Solver
from gradckpt.profiling.records import Profile

__all__ = ["measured_at_shape", "step_peak", "unseen_share", "verified_at_shape"]

#: A fitted profile whose allocator peak exceeds its tensor-level peak by at most this
#: share (a few scalars autograd keeps) is trusted under fake tensors without a real step.
TRUSTED_UNSEEN_SHARE = 1e-3

#: Real steps :func:`verified_at_shape` runs before it gives up on fake-chosen plans.
VERIFY_ROUNDS = 3


def step_peak(model: nn.Module, step: Callable[[], torch.Tensor], plan: Plan) -> int:
    """Bytes the allocator held above its level at entry while ``step`` ran under ``plan``.

    The plan installed before (if any) is installed again after, and the model's
    gradients, buffers and RNG are left as found.
    """
    with PlanSteps(model, step) as steps:
        _, reading = steps.run(plan)
    assert reading is not None
    return reading.peak_bytes


def _whole_peak(
    model: nn.Module, step: Callable[[], torch.Tensor], plan: Plan, prof: Profile, params: int
) -> int:
    """Parameters, the allocator's peak of one real ``step`` under ``plan``, and what the
    training step folded into ``prof`` (``optimizer=``) adds beyond forward and backward."""
    pred = simulate(prof, plan)
    extra = max(0, pred.peak_bytes - pred.fwd_bwd_peak_bytes)
    return params + step_peak(model, step, plan) + extra


def measured_at_shape(
    model: nn.Module,
    step: Callable[[], torch.Tensor],
    plan: Plan,
    budget: int,
    fitted: Profile,
) -> Plan:
    """``plan`` with the whole-step peak of one real ``step`` under it; BudgetError if over.

    The whole-step peak is the parameters, the allocator's peak during the step and,
    with a training step folded in (``optimizer=``), what its peak exceeded the forward
    and backward by at the fitted shape (optimizer state does not grow with the input).
    """
    whole = _whole_peak(model, step, plan, fitted, fitted.param_bytes)
    if whole > budget:
        raise BudgetError(
            f"the leanest plan measured {format_bytes(whole)} on a real step at this shape, "
            f"over the budget of {format_bytes(budget)}",
            least_peak_bytes=whole,
        )
    return replace(plan, budget_bytes=budget, predicted_peak_bytes=whole, peak_level="allocator")


def unseen_share(fitted: Profile | None) -> float:
    """The share of ``fitted``'s allocator peak its tensors do not account for (0 if unknown).

    What a fake profile at another shape cannot see either: kernel workspace beyond
    what :func:`~gradckpt.planning.solving.rescale.with_measured_workspace` carries over,
    temporaries the allocator rounds up. About 0 on transformers (tens of bytes);
    over 10% on a small UNet (convolution columns).
    """
    if fitted is None or fitted.peak_level != "allocator" or fitted.measured_peak_bytes <= 0:
        return 0.0
    gap = fitted.measured_peak_bytes - fitted.tracker_peak_bytes
    return max(0, gap) / fitted.measured_peak_bytes


def verified_at_shape(
    model: nn.Module,
    step: Callable[[], torch.Tensor],
    new_planner: Callable[[], Planner],
    budget: int,
    fitted: Profile,
    solver: str | Solver = "dp",
) -> Plan | None:
    """A plan from ``new_planner()``'s (fake) profile whose real ``step`` fits ``budget``.

    The first candidate is solved for the budget less :func:`unseen_share` of it (so the
    real step that checks it stays under the budget, not just the step after); each one
    measured over the budget is re-solved for a budget lower by its excess. The plan
    kept carries the measured whole-step peak (at the allocator). None when
    :data:`VERIFY_ROUNDS` real steps (or the leanest plan) did not fit: the caller
    falls back to its next route.
    """
    target = budget - int(unseen_share(fitted) * budget)
    for _ in range(VERIFY_ROUNDS):
        plan, whole_profile, leanest = _solved(new_planner, max(1, target), solver)
        whole = _whole_peak(model, step, plan, whole_profile, fitted.param_bytes)
        if whole <= budget:
            return replace(
                plan, budget_bytes=budget, predicted_peak_bytes=whole, peak_level="allocator"
            )
        if leanest:
            return None
        target -= whole - budget
    return None


def _solved(
    new_planner: Callable[[], Planner], target: int, solver: str | Solver
) -> tuple[Plan, Profile, bool]:
    """The plan for ``target`` (the leanest if none fits: True), by a planner that is gone
    before the step runs: the DP's tables are tensors the allocator would count in it."""
    planner = new_planner()
    try:
        return planner.plan(target, solver), planner.profile, False
    except BudgetError:
        pass
    return planner.least_peak()[0], planner.profile, True
