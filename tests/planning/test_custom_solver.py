"""A custom solver's plan goes through the same simulated prediction and budget check."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solve import solve
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.solvers import none_plan


def test_a_custom_solver_is_predicted_and_checked_like_the_built_in_ones(zoo):
    _, prof, _ = zoo.get("mlp")

    def boastful(profile, budget):  # claims a peak of 0 B for the plain plan
        return replace(none_plan(profile), predicted_peak_bytes=0)

    plain = solve(prof, prof.measured_peak_bytes * 2, boastful)
    assert plain.predicted_peak_bytes == simulate(prof, plain).peak_bytes > 0
    assert plain.solver == "boastful" and plain.budget_bytes == prof.measured_peak_bytes * 2
    with pytest.raises(BudgetError, match="boastful"):
        solve(prof, prof.measured_peak_bytes // 2, boastful)
    with pytest.raises(TypeError, match="not a gradckpt Plan"):
        solve(prof, prof.measured_peak_bytes, lambda p, b: "keep everything")
