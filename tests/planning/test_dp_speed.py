"""The fast DP (shared cells, pruned segment rows) answers exactly as the plain one.

On the chains of the zoo models: the same least time and the same schedule at
every budget on the grid, and so the same plan from ``solve_dp``.
"""

from __future__ import annotations

import math

import pytest

from gradckpt.planning.solving.brute import ReferenceDP, evaluate
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.chain import build_chain
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.solvers import least_peak_plan, solve_dp

from .conftest import ZOO_NAMES


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_fast_dp_equals_the_reference_dp_on_zoo_chains(zoo, name):
    _, prof, _ = zoo.get(name)
    model = build_chain(prof)
    fast, reference = ChainDP(model.chain), ReferenceDP(model.chain)
    assert fast.least_feasible() == reference.least_feasible()
    for m in range(model.chain.capacity + 1):
        want = reference.best_time(m)
        assert fast.best_time(m) == want or math.isclose(fast.best_time(m), want)
        if math.isfinite(want):
            tree = fast.schedule(m)
            assert tree == reference.schedule(m)
            assert evaluate(model.chain, tree)[0] <= m
    # And so the solver's plans are the same, budget by budget.
    least = least_peak_plan(prof, model, fast)[1].peak_bytes
    for share in (0.0, 0.3, 0.7, 1.0):
        budget = int(least + share * (prof.measured_peak_bytes - least))
        assert _solved(prof, budget, model, fast) == _solved(prof, budget, model, reference)


def _solved(prof, budget, model, dp):
    try:
        return solve_dp(prof, budget, model=model, dp=dp)
    except BudgetError as error:
        return str(error)
