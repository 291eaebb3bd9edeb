"""A step that calls the model several times is planned as one step, at the allocator.

A bi-encoder runs its anchors and its positives through one model; each call has
its own shape. The plan is for the sequence of calls (a ``CallsKey``); nothing is
switched or planned in the middle of a step; a combination no plan foresaw is
warned about with its predicted peak and planned before the next step. ``fit``
called from the model's own forward pre-hook gives that call a plan it can run.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import gradckpt
from gradckpt.apply.guard import guard_of
from gradckpt.planning.plans.call_key import CallsKey
from gradckpt.planning.plans.plan import Segment
from gradckpt.testing import make

pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt():
    return make("gpt", layers=4, seq=48, batch=8, vocab=512).model  # dropout 0.1


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (8, length + 1), generator=torch.Generator().manual_seed(seed))


def _lm(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _two_calls(model, short=32, long=48):
    a, b = _ids(short, 1), _ids(long, 2)
    return lambda: _lm(model, a) + _lm(model, b)


def _same(grads, ref):
    return grads.keys() == ref.keys() and all(torch.equal(grads[k], ref[k]) for k in ref)


def test_a_step_calling_the_model_at_two_shapes_holds_the_budget_for_five_steps(peak_and_grads):
    model = _gpt()
    plain = copy.deepcopy(model)
    plain_peak, _ = peak_and_grads(plain, _two_calls(plain))
    budget = int(0.7 * plain_peak)
    # chunking=False: the loss taken whole, so gradients are the plain run's bit for bit.
    plan = gradckpt.fit(model, _two_calls(model), budget, chunking=False)
    assert any(p.endswith("#1") for p, _ in plan.input_shapes)  # units of the second call
    for seed in range(5):
        peak, grads = peak_and_grads(model, _two_calls(model), seed)
        _, ref = peak_and_grads(plain, _two_calls(plain), seed)
        assert peak <= budget, (seed, peak, budget)
        assert _same(grads, ref), seed
    stats = gradckpt.shape_stats(model)
    assert stats.replans == 0 and stats.switches == 0 and stats.warnings == 0
    assert stats.active == "(8,32):int64 then (8,48):int64"


def test_fitted_on_one_shape_then_run_at_two_is_warned_once_and_planned_for_the_next_steps(
    peak_and_grads,
):
    model = _gpt()
    plain = copy.deepcopy(model)
    plain_peak, _ = peak_and_grads(plain, _two_calls(plain))
    budget = int(0.7 * plain_peak)
    a = _ids(32, 1)
    # One call: fits without recompute; chunking=False, so gradients stay bit for bit.
    gradckpt.fit(model, lambda: _lm(model, a), budget, chunking=False)
    peaks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(4):
            peak, grads = peak_and_grads(model, _two_calls(model), seed)
            _, ref = peak_and_grads(plain, _two_calls(plain), seed)
            peaks.append(peak)
            assert _same(grads, ref), seed
    said = [str(w.message) for w in caught if "did not foresee" in str(w.message)]
    assert len(said) == 1 and "(8,32):int64 then (8,48):int64" in said[0]
    # The first step ran the one-call plan (over the budget: said, with its predicted peak);
    # every later step runs the plan made for both calls.
    assert peaks[0] > budget and "predicted to peak at" in said[0]
    assert all(p <= budget for p in peaks[1:]), (peaks, budget)
    assert isinstance(guard_of(model).active, CallsKey)


def test_a_later_call_off_its_plan_never_switches_plans_inside_the_step():
    model = _gpt()
    gradckpt.fit(model, _two_calls(model), 0.7)
    switches = gradckpt.shape_stats(model).switches
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _two_calls(model, 32, 40)().backward()  # the second call at a length never planned
    stats = gradckpt.shape_stats(model)
    assert stats.switches == switches and stats.replans == 0  # nothing happened mid-step
    with pytest.warns(UserWarning, match="did not foresee"):
        _two_calls(model, 32, 48)().backward()  # planned between the steps, then said
    assert gradckpt.shape_stats(model).replans == 1


def test_shapes_of_a_two_call_step_take_one_entry_per_call():
    model = _gpt()
    plans = gradckpt.plan(model, _two_calls(model), 0.7, shapes=gradckpt.ShapeOptions([[16, 40]]))
    keys = [k.describe() for k, _ in plans]
    assert "(8,16):int64 then (8,40):int64" in keys
    with pytest.raises(TypeError, match="one per call"):
        gradckpt.plan(model, _two_calls(model), 0.7, shapes=gradckpt.ShapeOptions([16]))


@pytest.mark.parametrize("item", [{"idx": 3}, (1, 2)], ids=["dict", "tuple"])
def test_a_shapes_item_without_a_tensor_is_refused_before_profiling(item):
    model = _gpt()
    runs = []

    def loss_fn():
        runs.append(1)
        return _two_calls(model)()

    with pytest.raises(ValueError, match="holds no tensor"):
        gradckpt.fit(model, loss_fn, 0.7, shapes=gradckpt.ShapeOptions([item]))
    assert runs == []


def test_fit_from_the_models_forward_pre_hook_holds_the_budget_on_the_call_that_planned(
    peak_and_grads,
):
    ex = make("mlp", blocks=8, width=128, hidden=512, batch=256)
    plain_peak, _ = peak_and_grads(ex.model, ex.loss_fn)
    budget = int(0.8 * plain_peak)
    # The sqrt(N) scheme: segments on every run (the DP's choice at a budget follows the
    # measured op times, which move with the machine's load).
    prof = gradckpt.profile(ex.model, ex.loss_fn)
    made = []

    def plan_on_first_call(module, args):
        handle.remove()
        made.append(gradckpt.fit(ex.model, ex.loss_fn, budget, solver="sqrt", profiling=gradckpt.ProfileOptions(profile=prof),
                                 measure_candidates=0))  # fmt: skip

    handle = ex.model.register_forward_pre_hook(plan_on_first_call)
    first, _ = peak_and_grads(ex.model, ex.loss_fn)
    (plan,) = made
    assert any(isinstance(item, Segment) for item in plan.items)
    assert first <= budget, (first, budget)
    assert gradckpt.applied_plan(ex.model) is not plan  # the call in progress: no segments
    second, _ = peak_and_grads(ex.model, ex.loss_fn)
    assert gradckpt.applied_plan(ex.model) is plan  # from the next step on
    assert second <= budget, (second, budget)


def test_a_two_call_plan_applied_alone_learns_both_calls_and_holds_the_budget(peak_and_grads):
    model = _gpt()
    plain_peak, _ = peak_and_grads(model, _two_calls(model))
    budget = int(0.7 * plain_peak)
    plan = gradckpt.plan(model, _two_calls(model), budget)
    gradckpt.apply(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step is taken for an unforeseen one
        peaks = [peak_and_grads(model, _two_calls(model), seed)[0] for seed in range(3)]
    assert all(p <= budget for p in peaks), (peaks, budget)
    assert guard_of(model).active.describe() == "(8,32):int64 then (8,48):int64"


def test_an_unforeseen_combination_no_plan_fits_is_said_and_the_next_step_still_runs():
    model = _gpt()
    with pytest.raises(gradckpt.BudgetError) as least:
        gradckpt.plan(model, _two_calls(model, 16, 16), 1)
    gradckpt.fit(model, _two_calls(model, 16, 16), least.value.least_peak_bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _two_calls(model, 16, 48)().backward()  # its second call far longer
        _two_calls(model, 16, 16)().backward()  # the next step: not refused for it
    said = [str(w.message) for w in caught if "did not foresee" in str(w.message)]
    assert len(said) == 1 and "No plan fits it" in said[0]
