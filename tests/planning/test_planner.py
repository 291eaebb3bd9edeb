"""``Planner``: one profile's chain and DP built once, every question answered from them."""

from __future__ import annotations

import pytest

import gradckpt
from gradckpt.planning import planner as planner_module
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import Segment
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solve import solve
from gradckpt.planning.solving import chain as chain_module
from gradckpt.planning.solving import dp as dp_module
from gradckpt.planning.solving import solvers as solvers_module
from gradckpt.planning.solving.budget import BudgetError


@pytest.fixture
def builds(monkeypatch):
    """Counts of chain models and DP tables built (wherever the plan layer builds them)."""
    counts = {"chain": 0, "dp": 0}
    real_chain, real_dp = chain_module.build_chain, dp_module.ChainDP

    def build_chain(*args, **kwargs):
        counts["chain"] += 1
        return real_chain(*args, **kwargs)

    class ChainDP(real_dp):
        def __init__(self, *args, **kwargs):
            counts["dp"] += 1
            super().__init__(*args, **kwargs)

    for module in (planner_module, solvers_module):
        monkeypatch.setattr(module, "build_chain", build_chain)
        monkeypatch.setattr(module, "ChainDP", ChainDP)
    return counts


def test_chain_and_dp_are_built_once_for_every_question(zoo, builds):
    _, prof, _ = zoo.get("gpt")
    planner = Planner(prof)
    assert builds == {"chain": 0, "dp": 0}  # lazily: nothing until asked
    for budget in (0.9, 0.8, 0.7):
        planner.plan(budget)
    planner.frontier(points=6)
    planner.explain(0.8)
    assert builds == {"chain": 1, "dp": 1}
    planner.least_peak()  # its own chain, on times estimated from FLOPs (see least_peak_plan)
    planner.least_peak()
    assert builds == {"chain": 2, "dp": 2}


def test_planner_answers_as_the_solvers_and_the_api_do(zoo):
    ex, prof, _ = zoo.get("gpt")
    planner = Planner(prof)
    budget = prof.measured_peak_bytes  # every baseline fits the plain peak
    for solver in ("dp", "every_block", "save_matmuls", "sqrt"):
        assert planner.plan(budget, solver) == solve(prof, budget, solver)
    assert planner.plan(0.75) == gradckpt.plan(ex.model, ex.loss_fn, 0.75, profiling=gradckpt.ProfileOptions(profile=prof))
    assert planner.frontier() == gradckpt.frontier(ex.model, ex.loss_fn, profile=prof)
    explained = planner.explain(0.75)
    assert explained.kept_bytes == gradckpt.explain(prof, budget=0.75).kept_bytes
    least_plan, least = planner.least_peak()
    assert simulate(prof, least_plan).peak_bytes == least.peak_bytes
    with pytest.raises(BudgetError):
        planner.plan(least.peak_bytes - 1)


def test_planner_without_segments_plans_none_and_builds_once(zoo, builds):
    _, prof, _ = zoo.get("gpt")
    planner = Planner(prof, segments=False)
    plans = [planner.plan(share) for share in (0.95, 0.85, 0.75)]
    assert all(not isinstance(i, Segment) for p in plans for i in p.items)
    assert builds["chain"] == 1 and builds["dp"] == 1


def test_planner_refuses_what_is_not_a_profile():
    with pytest.raises(TypeError, match="Profile"):
        Planner("profile.json")


def test_cli_plan_builds_the_chain_once(builds, capsys, tmp_path):
    from gradckpt.cli import main

    # No --threads: the command runs in this process, whose thread count (and so
    # the other tests' floating-point sums) must not change.
    assert main(["plan", "tiny-gpt", "--budget", "0.8", "--repeats", "1", "--json",
                 "--out", str(tmp_path / "p.json")]) == 0  # fmt: skip
    # One chain and DP for the plan and the explanation, one (on estimated times)
    # for the least feasible peak it reports.
    assert builds == {"chain": 2, "dp": 2}


def test_every_budget_at_or_above_the_least_peak_is_met():
    # A torchtitan-style Llama's leanest plan slices the MLPs of every-block recompute,
    # a plan no DP schedule is: planning at that peak (fit does, when a real step's
    # workspace makes it plan tighter) was refused with the DP's higher least peak.
    from gradckpt.testing.wild import wild

    ex = wild("titan_llama", layers=2, dim=64, heads=4, seq=64, batch=2, vocab=256)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    least, pred = Planner(prof).least_peak()
    assert least.token_chunks  # the case at issue: the leanest plan chunks MLPs
    for budget in (pred.peak_bytes, pred.peak_bytes + 4096):
        plan = Planner(prof).plan(budget)
        assert simulate(prof, plan).peak_bytes <= budget
