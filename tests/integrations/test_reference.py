"""Two models in one step: a frozen reference (DPO/KL) and an EMA copy beside a planned model.

A DPO-style step runs a frozen reference model under ``no_grad`` next to the
trained policy. Under ``no_grad`` nothing is saved for backward, so the
reference adds no bytes to the planned step's peak; an applied model used as
its own reference (PEFT's ``disable_adapter`` pattern) runs its units plainly.
An EMA or reference made by ``copy.deepcopy`` of an applied model must run and
train its own weights with the plan.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import gradckpt
from gradckpt.measure import MemoryTracker
from gradckpt.testing import gpt

BUDGET = 0.6


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def dpo():
    """A policy, a frozen reference copy, and the step's pieces (chosen/rejected in pairs)."""
    ex = gpt(layers=4, d_model=64, seq=64, vocab=512, batch=4)
    reference = copy.deepcopy(ex.model).eval().requires_grad_(False)
    idx, targets = ex.inputs["idx"], ex.inputs["targets"]

    def logprob(model):
        logits = model(idx)
        return logits.log_softmax(-1).gather(2, targets.unsqueeze(-1)).squeeze(-1).sum(-1)

    def loss(policy_lp, reference_lp):
        margin = policy_lp - reference_lp
        return -F.logsigmoid(0.1 * (margin[0::2] - margin[1::2])).mean()

    def step_with_reference():
        with torch.no_grad():
            reference_lp = logprob(reference)
        return loss(logprob(ex.model), reference_lp)

    with torch.no_grad():
        precomputed = logprob(reference)

    def step_policy_only():
        return loss(logprob(ex.model), precomputed)

    return ex, reference, logprob, step_with_reference, step_policy_only


def _measure(model, step):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with MemoryTracker(model) as tracker:
        step().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes, grads


def test_a_frozen_reference_under_no_grad_costs_nothing(dpo):
    ex, reference, _, with_reference, policy_only = dpo
    plain_peak, plain_grads = _measure(ex.model, with_reference)
    assert plain_peak == _measure(ex.model, policy_only)[0]

    plan = gradckpt.fit(ex.model, with_reference, BUDGET, profiling=gradckpt.ProfileOptions(repeats=1))
    peak, grads = _measure(ex.model, with_reference)
    assert peak == _measure(ex.model, policy_only)[0]  # the reference adds nothing
    assert peak <= plan.budget_bytes < plain_peak
    assert abs(peak - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes
    assert grads.keys() == plain_grads.keys()
    for k, g in plain_grads.items():
        assert torch.equal(grads[k], g), k
    assert all(p.grad is None for p in reference.parameters())


def test_an_applied_model_as_its_own_reference_runs_plainly_under_no_grad(dpo):
    ex, _, logprob, with_reference, _ = dpo
    plain_copy = copy.deepcopy(ex.model)  # same weights, same (training) mode, no plan
    gradckpt.fit(ex.model, with_reference, BUDGET, profiling=gradckpt.ProfileOptions(repeats=1))

    def no_grad_run(model):
        torch.manual_seed(0)
        with MemoryTracker() as tracker, torch.no_grad():
            out = logprob(model)
        return out, tracker.peak_bytes

    (got, got_peak), (want, want_peak) = no_grad_run(ex.model), no_grad_run(plain_copy)
    assert torch.equal(got, want) and not got.requires_grad
    assert got_peak == want_peak


def test_a_deepcopy_of_an_applied_model_runs_and_trains_its_own_weights(dpo):
    ex, _, _, with_reference, _ = dpo
    before = copy.deepcopy(ex.model)  # the weights at copy time, never planned
    plain_peak, plain_grads = _measure(before, lambda: _loss(before, ex))
    plan = gradckpt.fit(ex.model, with_reference, BUDGET, profiling=gradckpt.ProfileOptions(repeats=1))
    ema = copy.deepcopy(ex.model)
    with torch.no_grad():  # the trained model moves on; the copy must not follow
        for p in ex.model.parameters():
            p.mul_(0.5)
    peak, grads = _measure(ema, lambda: _loss(ema, ex))
    assert all(p.grad is None for p in ex.model.parameters())
    assert grads.keys() == plain_grads.keys()
    for k, g in plain_grads.items():
        assert torch.equal(grads[k], g), k
    assert gradckpt.applied_plan(ema) == plan
    assert peak < plain_peak  # the copy is still checkpointed


def _loss(model, ex):
    logits = model(ex.inputs["idx"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ex.inputs["targets"].reshape(-1))
