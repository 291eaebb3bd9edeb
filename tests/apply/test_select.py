"""fit measures its candidate plans: a known number of steps, the model left as found."""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.apply.select import (
    candidate_plans,
    fastest_measured,
    pick_fastest,
    plan_kind,
    whole_unit_plan,
)
from gradckpt.planning import Plan
from gradckpt.planning.plans.plan import UnitChoice
from gradckpt.testing import make


def test_pick_keeps_the_predicted_best_unless_another_is_clearly_faster():
    assert pick_fastest([[1.30, 1.32, 1.31], [1.20, 1.21, 1.19]]) == 1
    assert pick_fastest([[1.30, 1.32, 1.31], [1.29, 1.30, 1.31]]) == 0  # within the margin
    assert pick_fastest([[1.10, 1.60, 1.12]]) == 0
    # Faster by the median but not in every round: noise cannot switch the plan.
    assert pick_fastest([[1.30, 1.32, 1.31], [1.20, 1.21, 1.40]]) == 0
    assert pick_fastest([[1.5, 1.5, 1.5], [1.3, 1.3, 1.3], [1.2, 1.2, 1.2]]) == 2


def test_candidates_fit_the_budget_and_start_with_the_planners_choice():
    ex = make("gpt", layers=4, d_model=32, heads=2, seq=16, vocab=64, batch=2)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    # 0.9: at 0.85 every other plan that fits is as lean as the choice and slower.
    chosen = gradckpt.plan(ex.model, ex.loss_fn, 0.9, profiling=gradckpt.ProfileOptions(profile=prof))
    found = candidate_plans(prof, chosen, 4)
    assert found[0] is chosen and 1 < len(found) <= 4
    assert len({p.items for p in found}) == len(found)
    assert all(p.predicted_peak_bytes <= chosen.budget_bytes for p in found)
    # No alternative is predicted both no leaner and no faster than the choice (#40):
    # each runs real steps, and such a plan only risks the budget.
    assert not any(
        p.predicted_peak_bytes >= chosen.predicted_peak_bytes
        and p.predicted_step_time >= chosen.predicted_step_time
        for p in found[1:]
    )
    whole = whole_unit_plan(prof, chosen.budget_bytes)
    rest = found[1:]
    if whole is not None and plan_kind(chosen) != "whole-unit":
        assert found[1].items == whole.items  # per-layer style is always measured
        rest = found[2:]
    assert [p.predicted_step_time for p in rest] == sorted(p.predicted_step_time for p in rest)


def test_whole_unit_plan_keeps_or_recomputes_units_whole_and_beats_every_block():
    ex = make("gpt", layers=4, d_model=32, heads=2, seq=16, vocab=64, batch=2)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    every = gradckpt.plan(ex.model, ex.loss_fn, 1.0, profiling=gradckpt.ProfileOptions(profile=prof), solver="every_block")
    budget = every.predicted_peak_bytes
    whole = whole_unit_plan(prof, budget)
    assert whole is not None
    assert all(isinstance(i, UnitChoice) and i.mode in ("keep", "recompute") for i in whole.items)
    assert whole.predicted_peak_bytes <= budget
    # The DP over keep/recompute can always fall back to every block: never predicted slower.
    assert whole.predicted_step_time <= every.predicted_step_time * (1 + 1e-9)
    chosen = gradckpt.plan(ex.model, ex.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof))
    found = candidate_plans(prof, chosen, 2)
    if whole.items != chosen.items:
        assert [p.items for p in found] == [chosen.items, whole.items]


def test_fit_measures_candidates_in_a_known_number_of_steps_and_leaves_state():
    ex = make("bn_convnet")
    model = ex.model
    calls = []

    def loss_fn() -> torch.Tensor:
        calls.append(1)
        return ex.loss_fn()

    buffers = {k: b.clone() for k, b in model.named_buffers()}
    rng = torch.get_rng_state()
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    calls.clear()
    plan = gradckpt.fit(model, loss_fn, 0.7, profiling=gradckpt.ProfileOptions(profile=prof), measure_candidates=2)
    try:
        count = len(candidate_plans(prof, gradckpt.plan(model, loss_fn, 0.7, profiling=gradckpt.ProfileOptions(profile=prof)), 2))
        assert len(calls) == 3 * (count + 1)  # rounds x (plain + each candidate)
        assert gradckpt.applied_plan(model) is plan
        assert plan.measured_overhead is not None
        low, high = plan.measured_overhead_range
        assert low <= plan.measured_overhead <= high
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        assert all(p.grad is None for p in model.parameters())
        for k, b in model.named_buffers():
            assert torch.equal(b, buffers[k]), f"buffer {k} changed"
        assert torch.equal(torch.get_rng_state(), rng)
        assert "measured overhead" in plan.summary()
        assert Plan.from_json(plan.to_json()) == plan
    finally:
        gradckpt.remove(model)


def test_measuring_is_off_with_zero_and_for_bad_counts():
    ex = make("mlp", blocks=3, width=16, hidden=32, batch=4)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    plan = gradckpt.fit(ex.model, ex.loss_fn, 1.0, profiling=gradckpt.ProfileOptions(profile=prof), measure_candidates=0)
    gradckpt.remove(ex.model)
    assert plan.measured_overhead is None
    with pytest.raises(ValueError, match="count >= 1"):
        fastest_measured(ex.model, ex.loss_fn, prof, plan, 0)
