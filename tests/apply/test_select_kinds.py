"""fit measures the best plan of each kind that fits, not only its choice and a whole-unit plan.

A selective plan can be priced too cheap (issue #31: predicted +24%, measured
+37%) while a segment plan that would have won is never measured. Here the
step's time is scripted per kind of plan (the work clock is replaced), so which
plan is fastest is known: the measured set must hold one plan of each kind
that fits at the budget, and the fastest of them must be the one installed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import gradckpt
from gradckpt.api import fitted
from gradckpt.apply import select
from gradckpt.apply.select import best_of_each_kind, candidate_plans, plan_kind
from gradckpt.measure.engine_costs import EngineCosts
from gradckpt.planning.planner import Planner
from gradckpt.profiling.fake import with_estimated_times
from gradckpt.testing import make

#: Step time over the plain step's, per kind: the segment plan is the fastest on this
#: "machine" although the planner predicts the selective one faster.
_SCRIPTED = {None: 1.0, "segment": 1.10, "whole-unit": 1.30, "selective": 1.50}
_ALL = {"selective", "segment", "whole-unit"}


@pytest.fixture(scope="module")
def setup():
    ex = make("gpt", layers=4, d_model=64, heads=4, seq=128, vocab=128, batch=8, seed=0)
    # Which budgets admit all three kinds depends on the op times; measured ones move with
    # the machine's load (under the suite on both cores three profiles in a row had no such
    # budget, CI 2026-12-05). These tests are about which plans are chosen and measured, not
    # about those times: op times from FLOPs and bytes and no engine costs make the
    # planner's picture the same on every machine.
    measured = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    estimated = with_estimated_times(measured, torch.device("cpu"))
    prof = replace(estimated, fake=False, engine_costs=EngineCosts())
    planner = Planner(prof)
    for point in planner.frontier(16):  # a budget where all three kinds fit
        chosen = planner.plan(point.peak_bytes)
        kinds = best_of_each_kind(planner, point.peak_bytes)
        if set(kinds) == _ALL and plan_kind(chosen) != "segment":
            return ex, prof, chosen, kinds
    pytest.fail("no budget where selective, segment and whole-unit plans all fit")


def test_best_of_each_kind_fits_and_is_of_its_kind(setup):
    _, _, chosen, kinds = setup
    budget = chosen.budget_bytes
    for kind, plan in kinds.items():
        assert plan_kind(plan) == kind
        assert plan.predicted_peak_bytes <= budget
    # The DP's own plan is the best of its kind (nothing of that kind beats it).
    assert kinds[plan_kind(chosen)].predicted_step_time <= chosen.predicted_step_time * (1 + 1e-9)


def test_candidates_hold_one_plan_of_each_kind(setup):
    _, prof, chosen, kinds = setup
    found = candidate_plans(prof, chosen, 3)
    assert found[0] is chosen
    assert {plan_kind(p) for p in found} == set(kinds) == _ALL
    assert plan_kind(found[1]) == "whole-unit"  # per-layer style stays second
    assert all(p.predicted_peak_bytes <= chosen.budget_bytes for p in found)


def test_fit_measures_each_kind_and_installs_the_fastest_measured(setup, monkeypatch):
    ex, prof, chosen, _ = setup
    model = ex.model
    now = [0.0]

    def clock() -> float:  # each step reads it 4 times: forward and backward halves
        now[0] += _SCRIPTED[plan_kind(p) if (p := gradckpt.applied_plan(model)) else None] / 2
        return now[0]

    measured: list = []
    real_apply = select.apply

    def spy(target, plan, **kwargs):
        measured.append(plan)
        return real_apply(target, plan, **kwargs)

    monkeypatch.setattr(select, "work_clock", lambda device: clock)
    monkeypatch.setattr(select, "apply", spy)
    # The kinds measured are what this test is about: the budget is the tensors' (as on a
    # GPU), so nothing is kept back for what malloc holds beside them on this CPU.
    monkeypatch.setattr(fitted, "malloc_in_use", lambda: None)
    at_allocator = replace(prof, beside_bytes=0)
    plan = gradckpt.fit(model, ex.loss_fn, chosen.budget_bytes, profiling=gradckpt.ProfileOptions(profile=at_allocator))
    try:
        kinds = {plan_kind(p) for p in measured}
        assert kinds == _ALL, f"measured kinds {kinds}"
        assert len(measured) == 3 * 3  # three candidates, three rounds: the documented cost
        fastest = min(measured, key=lambda p: _SCRIPTED[plan_kind(p)])
        installed = gradckpt.applied_plan(model)
        assert installed is plan and plan.items == fastest.items
        assert plan_kind(plan) == "segment" != plan_kind(chosen)
        assert plan.measured_overhead == pytest.approx(0.10)
        assert plan.predicted_peak_bytes <= chosen.budget_bytes
    finally:
        gradckpt.remove(model)
