"""Below recompute's floor with streamed offload, on Hugging Face GPT-2 and Llama configs.

With segments, the recompute-only floor is one block's backward after its
recompute: parameters, the gradients done so far and everything the block
saved. Streamed offload holds a tensor or two of what a block saved instead,
so ``offload=True`` fits at 0.9 x that floor. Each plan is run on the host-copy
backend and checked at the allocator (peak within the budget), bit for bit
against the plain step (dropout on), and for its host bytes (as predicted).
Chunking is off (``chunking=False``): the floor here is keep/recompute's, and a
chunked plan sums in another order, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import gradckpt
from gradckpt.apply.apply import applied_units
from gradckpt.engine.decisions import Offload
from gradckpt.engine.offload.runtime import OffloadRuntime
from gradckpt.integrations.hf.zoo import hf_example, run_step
from gradckpt.planning import simulate
from gradckpt.planning.solving.solvers import least_peak_plan

NARROW = dict(layers=8, hidden=32, heads=2, seq=128, batch=8, vocab=64)
CONFIGS = {
    "gpt2-narrow": ("gpt2", NARROW),
    "llama-narrow": ("llama", NARROW),
    "gpt2": ("gpt2", dict(layers=4, hidden=128, seq=128)),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    family, sizes = CONFIGS[request.param]
    ex = hf_example(family, **sizes)
    ex.model.config.use_cache = False  # training: no KV cache
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    return ex, prof, run_step(ex)


@pytest.fixture(scope="module")
def planned(model):
    """``offload=True`` at 0.9 x the recompute-only least peak: (budget, plan)."""
    ex, prof, _ = model
    _, without = least_peak_plan(prof)
    budget = int(0.9 * without.peak_bytes)
    return budget, gradckpt.plan(ex.model, ex.loss_fn, budget, chunking=False, profiling=gradckpt.ProfileOptions(profile=prof), offload=True)


def test_offload_fits_at_nine_tenths_of_the_recompute_only_floor(model, planned):
    ex, prof, plain = model
    budget, plan = planned
    with pytest.raises(gradckpt.BudgetError):
        gradckpt.plan(ex.model, ex.loss_fn, budget, chunking=False, profiling=gradckpt.ProfileOptions(profile=prof))
    assert plan.offload is not None and plan.offload.stream
    assert any(isinstance(u.decision, Offload) for u in plan.units)
    predicted = simulate(prof, plan)
    assert predicted.peak_bytes <= budget

    gradckpt.apply(ex.model, plan)
    try:
        step = run_step(ex)
        (session,) = {id(s.runtime.session): s.runtime.session for s in
                      applied_units(ex.model).values() if isinstance(s.runtime, OffloadRuntime)
                      }.values()  # fmt: skip
    finally:
        gradckpt.remove(ex.model)
    assert torch.equal(step.loss, plain.loss)
    assert step.grads.keys() == plain.grads.keys()
    assert all(torch.equal(step.grads[k], plain.grads[k]) for k in plain.grads)
    assert step.peak_bytes <= budget  # at the allocator
    assert session.backend.peak_host_bytes == predicted.host_bytes


def test_the_streamed_plan_says_so_and_round_trips(model, planned, tmp_path):
    _, prof, _ = model
    _, plan = planned
    plan.save(tmp_path / "p.json")
    loaded = gradckpt.Plan.load(tmp_path / "p.json")
    assert loaded == plan and loaded.offload.stream
    assert "streamed: each saved tensor out when saved, back one tensor ahead" in plan.summary()
    explanation = gradckpt.explain(prof, plan=plan)
    moved = [r for r in explanation.rows if r.status == "offloaded"]
    assert moved and all("streamed to host when" in r.why for r in moved)
    assert sum(r.nbytes for r in moved) == simulate(prof, plan).host_bytes


def test_fit_with_offload_plans_and_trains_within_the_budget_at_the_allocator():
    # fit never runs the plain step (55.7 MiB here): it plans from fake tensors and
    # measures only plans that fit; with offload, the leanest of those streams.
    from gradckpt.measure import AllocatorTracker, state_bytes

    family, sizes = CONFIGS["gpt2-narrow"]
    ex = hf_example(family, **sizes)
    ex.model.config.use_cache = False
    plain = run_step(ex)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    budget = int(0.9 * least_peak_plan(prof)[1].peak_bytes)
    held = state_bytes(ex.model)
    with AllocatorTracker() as allocator:
        plan = gradckpt.fit(ex.model, ex.loss_fn, budget, offload=True, chunking=False)
        step = run_step(ex)
    assert plan.offload is not None and plan.offload.stream
    assert held + allocator.peak_bytes <= budget  # planning, its measured steps and a step
    assert torch.equal(step.loss, plain.loss)
    assert all(torch.equal(step.grads[k], plain.grads[k]) for k in plain.grads)


def test_a_host_budget_the_streamed_plan_needs_is_held_and_a_smaller_one_refuses(model, planned):
    ex, prof, _ = model
    budget, plan = planned
    needs = simulate(prof, plan).host_bytes
    roomy = gradckpt.OffloadOptions(host_budget=needs)
    held = gradckpt.plan(ex.model, ex.loss_fn, budget, chunking=False, profiling=gradckpt.ProfileOptions(profile=prof), offload=roomy)
    assert held.offload.stream and simulate(prof, held).host_bytes <= needs
    with pytest.raises(gradckpt.BudgetError, match="within the host budget"):
        gradckpt.plan(ex.model, ex.loss_fn, budget, chunking=False, profiling=gradckpt.ProfileOptions(profile=prof),
                      offload=gradckpt.OffloadOptions(host_budget=needs // 4))  # fmt: skip
