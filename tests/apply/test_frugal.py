"""Plans made from fake tensors are checked on real steps, and what a step holds decides."""

from __future__ import annotations

import pytest

import gradckpt
from gradckpt.apply import measured_step
from gradckpt.measure import AllocatorTracker
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.testing import make


def _halfway(ex) -> int:
    """Halfway from the least peak to the plain one (fake tensors: nothing runs)."""
    fake = gradckpt.profile(ex.model, ex.loss_fn, fake=True)
    least = gradckpt.Planner(fake).least_peak()[1].peak_bytes
    return (least + fake.measured_peak_bytes) // 2


def test_a_reserved_high_water_over_the_budget_refuses_the_plan(monkeypatch):
    # CUDA's caching allocator can reserve more than it hands out; an OOM sees the
    # reserved bytes. Simulated here: every step reports a reserve over the budget.
    ex = make("gpt", layers=4, d_model=64, seq=64, vocab=256, batch=4)
    budget = _halfway(ex)

    class Reserving(AllocatorTracker):
        def __exit__(self, *exc: object) -> None:
            super().__exit__(*exc)
            self.reserved_high_water_bytes = 2 * budget

    monkeypatch.setattr(measured_step, "AllocatorTracker", Reserving)
    with pytest.raises(BudgetError, match="leanest plan measured"):
        gradckpt.fit(ex.model, ex.loss_fn, budget)
    assert gradckpt.applied_plan(ex.model) is None


def test_the_plain_step_never_runs_above_a_byte_budget():
    ex = make("gpt", layers=4, d_model=64, seq=64, vocab=256, batch=4)
    budget = _halfway(ex)
    plain = gradckpt.profile(ex.model, ex.loss_fn, repeats=1).measured_peak_bytes
    with AllocatorTracker() as at:
        plan = gradckpt.fit(ex.model, ex.loss_fn, budget)
    assert gradckpt.measure.state_bytes(ex.model) + at.peak_bytes <= budget < plain
    assert plan.peak_level == "allocator"  # checked on real steps
    assert plan.measured_overhead is None  # no plain step ran to compare with
    gradckpt.remove(ex.model)
