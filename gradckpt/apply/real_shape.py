"""One real step at a new shape under a given plan, measured at the allocator.

What the re-planner (:class:`gradckpt.replan.ShapePlanner`) falls back on when a
shape cannot be profiled under fake tensors (MoE kernels whose fake version is
stricter than the real one, a loss that calls ``nonzero()``, a branch on a
value): the step at that shape runs once under the leanest plan known, inside
:class:`~gradckpt.measure.AllocatorTracker`, and the plan is kept if what the
allocator held fits the budget. Like :mod:`gradckpt.apply.frugal`, the step
starts from and leaves the model's gradients, buffers and RNG as found, so the
user's own step that follows is the one a plain model would run.

Example:
    >>> plan = measured_at_shape(model, step, leanest, budget_bytes, fitted_profile)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from gradckpt.apply.apply import applied_plan, install_plan, remove
from gradckpt.measure.allocator import AllocatorTracker
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.budget import BudgetError
from gradckpt.planning.plan import Plan
from gradckpt.planning.simulate import simulate
from gradckpt.profiling import adapters
from gradckpt.profiling.records import Profile
from gradckpt.profiling.state import StepState

__all__ = ["measured_at_shape", "step_peak"]


def step_peak(model: nn.Module, step: Callable[[], torch.Tensor], plan: Plan) -> int:
    """Bytes the allocator held above its level at entry while ``step`` ran under ``plan``.

    The plan installed before (if any) is installed again after, and the model's
    gradients, buffers and RNG are left as found.
    """
    before = applied_plan(model)
    state = StepState(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with adapters.preparing(model), state.watching_modules():
            install_plan(model, plan)
            state.reset()
            with AllocatorTracker(device) as tracker:
                loss = step()
                state.adopt_graph(loss)
                loss.backward()
                del loss
    finally:
        state.restore()
        if before is not None:
            install_plan(model, before)
        elif applied_plan(model) is not None:
            remove(model)
    return tracker.peak_bytes


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
    pred = simulate(fitted, plan)
    extra = max(0, pred.peak_bytes - pred.fwd_bwd_peak_bytes)
    whole = fitted.param_bytes + step_peak(model, step, plan) + extra
    if whole > budget:
        raise BudgetError(
            f"the leanest plan measured {format_bytes(whole)} on a real step at this shape "
            f"(it could not be profiled under fake tensors), over the budget of "
            f"{format_bytes(budget)}",
            least_peak_bytes=whole,
        )
    return replace(plan, budget_bytes=budget, predicted_peak_bytes=whole, peak_level="allocator")
