"""Plans across each zoo model's frontier: within budget, predicted right, gradients unchanged."""

from __future__ import annotations

import pytest

import gradckpt
from gradckpt.planning.solve import solve
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.chain import build_chain
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.solvers import (
    every_kth_plan,
    finish,
    least_peak_plan,
)

from .conftest import (
    ZOO_NAMES,
    assert_dp_not_slower_than_baselines,
    assert_same_step,
    assert_step_matches,
    frontier_budgets,
    run_step,
)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_dp_plans_fit_predict_and_keep_gradients(zoo, name):
    ex, prof, plain = zoo.get(name)
    for budget in frontier_budgets(prof):
        plan = solve(prof, budget, "dp")
        gradckpt.apply(ex.model, plan)
        try:
            step = run_step(ex)
        finally:
            gradckpt.remove(ex.model)
        assert step.peak <= budget, f"{name}: measured {step.peak} over budget {budget}"
        assert abs(plan.predicted_peak_bytes - step.peak) <= 0.05 * step.peak
        assert_step_matches(plan, step, plain)
    # remove() gives the plain model back exactly.
    after = run_step(ex)
    assert after.peak == plain.peak
    assert_same_step(after, plain)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_dp_is_never_predicted_worse_than_a_baseline(zoo, name):
    _, prof, _ = zoo.get(name)
    assert_dp_not_slower_than_baselines(name, prof)


@pytest.mark.parametrize("name", ["gpt", "resnet", "bn_convnet"])
def test_dp_reaches_below_checkpointing_every_block(zoo, name):
    _, prof, _ = zoo.get(name)
    _, every = finish(prof, every_kth_plan(prof, 1), None, "every_block")
    model = build_chain(prof)
    least_plan, least = least_peak_plan(prof, model, ChainDP(model.chain))
    assert least.peak_bytes < every.peak_bytes
    assert any(isinstance(item, gradckpt.Segment) for item in least_plan.items)


def test_budget_below_least_feasible_names_the_least_peak(zoo):
    _, prof, _ = zoo.get("gpt")
    model = build_chain(prof)
    _, least = least_peak_plan(prof, model, ChainDP(model.chain))
    with pytest.raises(BudgetError) as info:
        solve(prof, least.peak_bytes // 2, "dp")
    assert info.value.least_peak_bytes == least.peak_bytes
    message = str(info.value)
    assert "least peak" in message and "MiB" in message and "parameters" in message


def test_unknown_solver_is_refused(zoo):
    _, prof, _ = zoo.get("mlp")
    with pytest.raises(ValueError, match="unknown solver"):
        solve(prof, prof.measured_peak_bytes, "magic")
