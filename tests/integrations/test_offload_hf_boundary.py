"""Offloaded boundaries on Hugging Face GPT-2 and Llama (configs, random weights).

Narrow models with long sequences, so that the block inputs recompute keeps
are a real share of the peak. Host-copy backend on CPU: every plan that runs is
checked at the allocator (peak within the budget), bit for bit against the
plain step (dropout on), and for its host bytes (as predicted, within the host
budget).
Chunking is off (``chunking=False``): the floor here is keep/recompute's, and a
chunked plan sums in another order, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import gradckpt
from gradckpt.apply.apply import applied_units
from gradckpt.engine.decisions import RecomputeOffload
from gradckpt.engine.offload.runtime import OffloadRuntime
from gradckpt.integrations.hf.zoo import hf_example, run_step
from gradckpt.planning import simulate
from gradckpt.planning.kinds.offload.floor import least_peak_offload
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.solving.solvers import least_peak_plan

SIZES = dict(layers=8, hidden=32, heads=2, seq=128, batch=8, vocab=64)
OPTIONS = OffloadOptions(min_bytes=1024, host_budget=4 << 20)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def narrow(request):
    ex = hf_example(request.param, **SIZES)
    ex.model.config.use_cache = False  # training: no KV cache
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    return ex, prof, run_step(ex)


def _run(ex, plan):
    gradckpt.apply(ex.model, plan)
    try:
        step = run_step(ex)
        (session,) = {id(s.runtime.session): s.runtime.session for s in
                      applied_units(ex.model).values() if isinstance(s.runtime, OffloadRuntime)
                      }.values()  # fmt: skip
    finally:
        gradckpt.remove(ex.model)
    return step, session.backend.peak_host_bytes


def _check(ex, prof, plan, plain, budget) -> None:
    """Run ``plan``: bit-equal, within ``budget`` at the allocator, host bytes as predicted."""
    assert any(isinstance(u.decision, RecomputeOffload) for u in plan.units)
    step, host = _run(ex, plan)
    assert torch.equal(step.loss, plain.loss)
    assert step.grads.keys() == plain.grads.keys()
    assert all(torch.equal(step.grads[k], plain.grads[k]) for k in plain.grads)
    assert step.peak_bytes <= budget  # at the allocator
    assert host == simulate(prof, plan).host_bytes <= OPTIONS.host_budget


def test_without_segments_the_plan_fits_below_the_recompute_only_floor(narrow):
    ex, prof, plain = narrow
    _, without = least_peak_plan(prof, segments=False)
    _, floor = least_peak_offload(prof, OPTIONS, segments=False)
    assert floor.peak_bytes < without.peak_bytes
    budget = (floor.peak_bytes + without.peak_bytes) // 2
    with pytest.raises(gradckpt.BudgetError):
        gradckpt.plan(ex.model, ex.loss_fn, budget, chunking=False, profiling=gradckpt.ProfileOptions(profile=prof), segments=False)
    plan = gradckpt.plan(ex.model, ex.loss_fn, budget, chunking=False, profiling=gradckpt.ProfileOptions(profile=prof), segments=False,
                         offload=OPTIONS)  # fmt: skip
    assert plan.predicted_peak_bytes <= budget
    _check(ex, prof, plan, plain, budget)


def test_near_the_floor_moving_boundaries_is_faster_and_fits(narrow):
    ex, prof, plain = narrow
    _, least = least_peak_plan(prof)
    budget = int(1.02 * least.peak_bytes)
    recompute = gradckpt.plan(ex.model, ex.loss_fn, budget, chunking=False, profiling=gradckpt.ProfileOptions(profile=prof))
    plan = gradckpt.plan(ex.model, ex.loss_fn, budget, chunking=False, profiling=gradckpt.ProfileOptions(profile=prof), offload=OPTIONS)
    assert plan.predicted_step_time < recompute.predicted_step_time
    _check(ex, prof, plan, plain, budget)


def test_below_both_floors_the_error_names_both(narrow):
    ex, prof, _ = narrow
    _, floor = least_peak_offload(prof, OPTIONS)
    with pytest.raises(gradckpt.BudgetError, match="With offload within the host budget") as e:
        gradckpt.plan(ex.model, ex.loss_fn, int(0.9 * floor.peak_bytes), profiling=gradckpt.ProfileOptions(profile=prof),
                      offload=OPTIONS)  # fmt: skip
    assert e.value.least_peak_bytes == floor.peak_bytes
