"""``measure_candidates=0`` and a given profile: a ``loss_fn`` that reads ``loss.item()`` works.

Issue #27: ``fit(profile=..., measure_candidates=0)`` and ``plan(profile=...,
shapes=...)`` ran ``loss_fn`` under fake tensors to see the model call's
shapes, and a ``loss_fn`` that logs ``loss.item()`` raised there. The shapes
are read at the model call; nothing of the step after it runs on fake tensors.
"""

from __future__ import annotations

import torch

import gradckpt
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.plans.planset import PlanSet
from gradckpt.testing import make


def _logging_step():
    ex = make("gpt", layers=2, d_model=32, heads=2, seq=32, vocab=64, batch=2, seed=0)
    logged: list[float] = []

    def loss_fn() -> torch.Tensor:
        loss = ex.loss_fn()
        logged.append(loss.item())  # a metric logged from the step, as trainers do
        return loss

    return ex, loss_fn, logged


def test_fit_with_a_profile_and_no_measuring_runs_a_loss_fn_that_reads_item():
    ex, loss_fn, logged = _logging_step()
    prof = gradckpt.profile(ex.model, loss_fn, repeats=1)
    logged.clear()
    plan = gradckpt.fit(ex.model, loss_fn, 0.8, profiling=gradckpt.ProfileOptions(profile=prof), measure_candidates=0)
    try:
        assert isinstance(plan, Plan) and plan.measured_overhead is None
        assert gradckpt.applied_plan(ex.model) is plan
        assert logged == []  # nothing ran for real: the plan comes from the profile
        # The call's shape was seen: the model is guarded (a call at it needs no re-plan).
        loss_fn().backward()
        stats = gradckpt.shape_stats(ex.model)
        assert stats is not None and stats.calls == 1
        assert stats.replans == 0 and stats.switches == 0
    finally:
        gradckpt.remove(ex.model)


def test_plan_with_a_profile_and_shapes_runs_a_loss_fn_that_reads_item():
    ex, loss_fn, _ = _logging_step()
    prof = gradckpt.profile(ex.model, loss_fn, repeats=1)
    plans = gradckpt.plan(ex.model, loss_fn, 0.8, profiling=gradckpt.ProfileOptions(profile=prof), shapes=gradckpt.ShapeOptions([16]))
    assert isinstance(plans, PlanSet) and len(plans.entries) == 2
    assert gradckpt.applied_plan(ex.model) is None  # plan() leaves the model untouched
