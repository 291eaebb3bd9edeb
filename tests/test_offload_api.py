"""``offload=`` on plan / fit / frontier: the choice, errors before profiling, the frontier."""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.testing import make


@pytest.fixture(scope="module")
def gpt():
    ex = make("gpt")
    return ex, gradckpt.profile(ex.model, ex.loss_fn, repeats=1)


def test_plan_offload_true_uses_the_default_link(gpt):
    ex, prof = gpt
    plan = gradckpt.plan(ex.model, ex.loss_fn, 0.8, profiling=gradckpt.ProfileOptions(profile=prof), offload=True)
    assert plan.offload == gradckpt.OffloadOptions()
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_plan_offload_false_is_the_plain_planner(gpt):
    ex, prof = gpt
    plain = gradckpt.plan(ex.model, ex.loss_fn, 0.8, profiling=gradckpt.ProfileOptions(profile=prof))
    off = gradckpt.plan(ex.model, ex.loss_fn, 0.8, profiling=gradckpt.ProfileOptions(profile=prof), offload=False)
    assert off == plain and off.offload is None
    assert all(u.mode != "offload" for u in off.units)


def _best_at(points, budget):
    """The least overhead of a frontier's points whose peak fits ``budget`` (inf if none)."""
    return min((p.overhead for p in points if p.peak_bytes <= budget), default=float("inf"))


def test_frontier_with_offload_is_at_or_below_everywhere_and_below_somewhere(gpt):
    ex, prof = gpt
    without = gradckpt.frontier(ex.model, ex.loss_fn, profile=prof, points=12)
    with_offload = gradckpt.frontier(
        ex.model, ex.loss_fn, profile=prof, points=12,
        offload=gradckpt.OffloadOptions(d2h_bandwidth=25e9, h2d_bandwidth=25e9, min_bytes=1024),
    )  # fmt: skip
    budgets = sorted({p.peak_bytes for p in without + with_offload})
    gaps = [_best_at(without, b) - _best_at(with_offload, b) for b in budgets]
    assert all(g >= 0 for g in gaps)
    assert any(g > 0 for g in gaps)
    assert any(u.mode == "offload" for p in with_offload for u in p.plan.units)


def test_bad_offload_value_fails_before_profiling():
    ex = make("mlp")
    calls = []

    def loss_fn():
        calls.append(1)
        return ex.loss_fn()

    with pytest.raises(TypeError, match="offload= is False"):
        gradckpt.plan(ex.model, loss_fn, 0.5, offload="fast")
    with pytest.raises(ValueError, match="solver='dp'"):
        gradckpt.plan(ex.model, loss_fn, 0.5, offload=True, solver="sqrt")
    with pytest.raises(ValueError, match="cannot be combined"):
        gradckpt.fit(ex.model, loss_fn, 0.5, offload=True, compile=True)
    with pytest.raises(ValueError, match="host_budget"):
        gradckpt.plan(ex.model, loss_fn, 0.5, offload=gradckpt.OffloadOptions(host_budget=-1))
    assert calls == []
    assert gradckpt.applied_plan(ex.model) is None


def test_fit_with_offload_applies_and_trains_exactly(gpt):
    ex, prof = gpt
    torch.manual_seed(3)
    ex.loss_fn().backward()
    plain = {k: p.grad.clone() for k, p in ex.model.named_parameters()}
    ex.model.zero_grad(set_to_none=True)
    # Without chunking: a chunked linear head frees this much for no recompute at all.
    plan = gradckpt.fit(ex.model, ex.loss_fn, 0.8, profiling=gradckpt.ProfileOptions(profile=prof), measure_candidates=0, chunking=False,
                        offload=gradckpt.OffloadOptions(min_bytes=1024))  # fmt: skip
    try:
        assert any(u.mode == "offload" for u in plan.units)
        torch.manual_seed(3)
        ex.loss_fn().backward()
        for k, p in ex.model.named_parameters():
            assert torch.equal(p.grad, plain[k]), k
    finally:
        gradckpt.remove(ex.model)
        ex.model.zero_grad(set_to_none=True)
