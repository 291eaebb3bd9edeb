"""Transformers models across sequence lengths: the issue's "fit at 128, then 384 and 512"
case holds the budget by default with plain gradients, and the monotone-peak proof that lets
a shorter sequence run under a longer one's plan."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import gradckpt
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.planning.plans.planset import proves_monotone

pytest.importorskip("transformers")
from gradckpt.integrations.hf.zoo import hf_example


def _example(name, longest=512, batch=2):
    ex = hf_example(name, layers=2, hidden=64, heads=4, seq=longest, batch=batch, vocab=128)
    ex.model.config.use_cache = False  # as fit sets it; a plain twin must run the same ops
    return ex


def _batch(ex, length):
    ids = ex.inputs["input_ids"][:, :length]
    return {"input_ids": ids, "labels": ids}


def _step(model, batch, seed, measure=True):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    # The peak at the allocator (kernel workspaces included), plus parameters and buffers.
    with AllocatorTracker() if measure else contextlib.nullcontext() as allocator:
        model(**batch).loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return state_bytes(model) + allocator.peak_bytes if measure else None, grads


def _fake_profile(model, batch):
    return gradckpt.profile(model, lambda: model(**batch).loss, fake=True)


def _least_peak(model, batch, prof):
    try:
        gradckpt.plan(model, lambda: model(**batch).loss, 1, profiling=gradckpt.ProfileOptions(profile=prof))
    except gradckpt.BudgetError as exc:
        return exc.least_peak_bytes
    raise AssertionError("a one-byte budget fitted")


def test_gpt2_fit_at_128_then_384_and_512_holds_the_budget_with_plain_gradients():
    ex = _example("gpt2", batch=1)
    model = ex.model
    plain = copy.deepcopy(model)
    # The budget: between the least peak at 512 and the plain peak at 384, so the
    # plan made at 128 (which keeps everything) would break it at both longer lengths.
    plain_384 = _fake_profile(model, _batch(ex, 384))
    least_512 = _least_peak(model, _batch(ex, 512), _fake_profile(model, _batch(ex, 512)))
    assert least_512 < plain_384.measured_peak_bytes
    budget = (least_512 + plain_384.measured_peak_bytes) // 2

    fitted = gradckpt.fit(model, lambda: model(**_batch(ex, 128)).loss, budget, profiling=gradckpt.ProfileOptions(repeats=1))
    assert gradckpt.simulate(plain_384, fitted).peak_bytes > budget  # the old plan would not hold
    for seed, length in enumerate((128, 384, 512, 384)):
        peak, grads = _step(model, _batch(ex, length), seed)
        _, plain_grads = _step(plain, _batch(ex, length), seed, measure=False)
        active = gradckpt.applied_plan(model)
        assert peak <= budget, (length, peak, budget)
        # At the allocator the model misses a few scalars autograd keeps (tens of bytes).
        assert abs(peak - active.predicted_peak_bytes) <= 1e-3 * peak, length
        assert grads.keys() == plain_grads.keys()
        assert all(torch.equal(grads[k], plain_grads[k]) for k in grads), length
    stats = gradckpt.shape_stats(model)
    assert stats.replans == 2 and stats.plans == 3 and stats.switches == 3
    assert stats.rescaled == 1  # 384 was profiled (and the scaling built), 512 rescaled


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_peak_is_monotone_in_sequence_length(name):
    """The proof behind round_up for these families: same event line, no storage larger."""
    ex = _example(name, longest=128)
    model = ex.model
    profiles = {n: _fake_profile(model, _batch(ex, n)) for n in (17, 64, 100, 128)}
    for short in (17, 64, 100):
        assert proves_monotone(profiles[short], profiles[128]), short
        assert not proves_monotone(profiles[128], profiles[short])  # the check can fail
    plan = gradckpt.plan(model, lambda: model(**_batch(ex, 128)).loss, 0.6, profiling=gradckpt.ProfileOptions(profile=profiles[128]))
    peaks = [gradckpt.simulate(profiles[n], plan).peak_bytes for n in (17, 64, 100, 128)]
    assert peaks == sorted(peaks) and peaks[-1] == plan.predicted_peak_bytes


def test_round_up_runs_a_shorter_sequence_under_the_longer_plan_without_planning():
    ex = _example("gpt2", longest=128)
    model = ex.model
    long = _fake_profile(model, _batch(ex, 128))
    budget = (_least_peak(model, _batch(ex, 128), long) + long.measured_peak_bytes) // 2
    gradckpt.fit(
        model, lambda: model(**_batch(ex, 64)).loss, budget, shapes=gradckpt.ShapeOptions([128], round_up=True), profiling=gradckpt.ProfileOptions(repeats=1),    )
    plans = gradckpt.shape_stats(model).plans
    long_plan_peak = None
    for length in (128, 100, 64, 17):
        peak, _ = _step(model, _batch(ex, length), 0)
        if length == 128:
            long_plan_peak = peak
        else:
            assert peak <= long_plan_peak
        assert peak <= gradckpt.applied_plan(model).budget_bytes
    stats = gradckpt.shape_stats(model)
    assert stats.replans == 0 and stats.plans == plans == 2
    assert "(2,64)" in stats.active  # 64 has its own plan; 100 and 17 ran under 128's
