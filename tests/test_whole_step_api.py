"""The budget is the device: fit/plan hold the whole training step at the allocator.

Every check here is at the allocator (``AllocatorTracker``: torch's CPU
allocator events), over whole steps: forward and backward of every
micro-batch, ``optimizer.step()`` included, from the call that plans to the end
of the 5th step.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gradckpt
from gradckpt.integrations.hf import disable_cache
from gradckpt.integrations.hf.zoo import hf_example
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.measure.device import DeviceMemory
from gradckpt.planning.solving.budget import BudgetError

pytestmark = pytest.mark.usefixtures("one_thread")


def _train(model, loss_fn, opt, k: int, steps: int = 5, set_to_none: bool = True) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for _ in range(k):
            loss = loss_fn()
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return losses


def _example(name: str):
    return hf_example(name, layers=3, hidden=64, heads=4, seq=64, batch=4, vocab=256)


def _or_the_budget_named(verb, budget: int):
    """``verb(budget)``, or ``verb`` at the budget its refusal names. A byte budget also holds
    what the step and planning take from malloc beside the tensors (#40), ~1 MiB on these
    6-10 MiB steps; where only the tensors fit, ``fit`` plans for them and warns.
    Returns (the result, the budget it was made for)."""
    try:
        return verb(budget), budget
    except BudgetError as e:
        assert e.least_peak_bytes is not None and e.least_peak_bytes > budget
        return verb(e.least_peak_bytes), e.least_peak_bytes


def _plain(name: str, k: int, set_to_none: bool = True) -> tuple[int, list[float]]:
    """The plain run's whole-step allocator high-water over 5 steps, and its losses."""
    ex = _example(name)
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-3)
    torch.manual_seed(5)
    with AllocatorTracker() as at:
        losses = _train(ex.model, ex.loss_fn, opt, k, set_to_none=set_to_none)
    return state_bytes(ex.model) + at.peak_bytes, losses


@pytest.mark.parametrize(("name", "k"), [("gpt2", 1), ("gpt2", 4), ("llama", 1), ("llama", 4)])
def test_fit_holds_the_whole_step_from_planning_to_the_5th_step(name, k):
    plain_peak, plain_losses = _plain(name, k)
    budget = int(0.6 * plain_peak)
    ex = _example(name)
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-3)
    with AllocatorTracker() as everything:
        plan, budget = _or_the_budget_named(
            lambda b: gradckpt.fit(ex.model, ex.loss_fn, b, step=gradckpt.StepOptions(optimizer=opt, accumulation_steps=k)),
            budget,
        )
        torch.manual_seed(5)
        with AllocatorTracker() as steps:
            losses = _train(ex.model, ex.loss_fn, opt, k)
    params = state_bytes(ex.model)
    assert params + everything.peak_bytes <= budget, (params + everything.peak_bytes, budget)
    measured = params + steps.peak_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.02 * measured, (
        plan.predicted_peak_bytes, measured)  # fmt: skip
    assert plan.step.optimizer.startswith("AdamW") and plan.step.accumulation_steps == k
    if any(u.mode == "chunk" for u in plan.units):  # a chunked loss: sums in another order
        assert losses == pytest.approx(plain_losses, rel=1e-5, abs=0)
    else:
        assert losses == plain_losses  # checkpointing changed memory, not the training


def test_plan_then_apply_holds_it_with_gradients_never_set_to_none():
    plain_peak, _ = _plain("gpt2", 1, set_to_none=False)
    budget = int(0.6 * plain_peak)
    ex = _example("gpt2")
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-3)
    with AllocatorTracker() as everything:
        plan, budget = _or_the_budget_named(
            lambda b: gradckpt.plan(ex.model, ex.loss_fn, b, step=gradckpt.StepOptions(optimizer=opt, set_to_none=False)),
            budget,
        )
        disable_cache(ex.model)  # as plan's warning says: it was planned without a KV cache
        gradckpt.apply(ex.model, plan)
        with AllocatorTracker() as steps:
            _train(ex.model, ex.loss_fn, opt, 1, set_to_none=False)
    params = state_bytes(ex.model)
    assert params + everything.peak_bytes <= budget
    assert plan.step.phase == "forward/backward, gradients resident"
    measured = params + steps.peak_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.02 * measured


def test_a_budget_above_the_plain_step_profiles_it_for_real():
    ex = _example("gpt2")
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-3)
    whole = gradckpt.profile(ex.model, ex.loss_fn, optimizer=opt, repeats=1)
    plan = gradckpt.plan(ex.model, ex.loss_fn, 2 * whole.measured_peak_bytes, step=gradckpt.StepOptions(optimizer=opt))
    assert plan.peak_level == "allocator" and plan.baseline_peak_bytes == whole.measured_peak_bytes


def test_auto_reads_the_device_and_says_its_rule():
    ex = _example("gpt2")
    plan = gradckpt.plan(ex.model, ex.loss_fn, "auto", step=gradckpt.StepOptions(optimizer="adamw"))
    assert plan.step.budget_rule.startswith("MemAvailable")
    assert plan.step.headroom > 0 and plan.budget_bytes > plan.predicted_peak_bytes
    assert "budget from the device: MemAvailable" in plan.summary()


def test_parameters_and_state_over_the_device_is_one_line(monkeypatch):
    ex = _example("gpt2")
    small = DeviceMemory("cpu", 1 << 30, 2 * state_bytes(ex.model), 0, 0, "a small device")
    monkeypatch.setattr("gradckpt.api.budget.device_memory", lambda *a, **k: small)
    with pytest.raises(BudgetError) as err:
        gradckpt.fit(ex.model, ex.loss_fn, "auto", step=gradckpt.StepOptions(optimizer="adamw"))
    message = str(err.value)
    assert "\n" not in message and "parameters (" in message and "optimizer state (" in message
    assert gradckpt.applied_plan(ex.model) is None


def test_bad_step_arguments_are_refused_before_profiling():
    ex = _example("gpt2")
    model = copy.deepcopy(ex.model)
    with pytest.raises(ValueError, match="accumulation_steps"):
        gradckpt.fit(model, ex.loss_fn, "1GiB", step=gradckpt.StepOptions(accumulation_steps=0))
    with pytest.raises(TypeError, match="set_to_none"):
        gradckpt.plan(model, ex.loss_fn, "1GiB", step=gradckpt.StepOptions(set_to_none="yes"))
    with pytest.raises(ValueError, match="optimizer=None"):
        gradckpt.plan(model, ex.loss_fn, "1GiB", step=gradckpt.StepOptions(optimizer="lion"))
    assert gradckpt.applied_plan(model) is None


def test_a_new_shape_is_planned_for_the_whole_step_too():
    plain_peak, _ = _plain("gpt2", 2)
    budget = int(0.6 * plain_peak)
    ex = _example("gpt2")
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-3)
    first = gradckpt.fit(ex.model, ex.loss_fn, budget, step=gradckpt.StepOptions(optimizer=opt, accumulation_steps=2))
    ids = ex.inputs["input_ids"][:, :48]
    batch = {"input_ids": ids, "labels": ids}
    with AllocatorTracker() as at:
        _train(ex.model, lambda: ex.model(**batch).loss, opt, 2)
    replanned = gradckpt.applied_plan(ex.model)
    assert replanned is not first and gradckpt.shape_stats(ex.model).replans == 1
    assert replanned.step is not None and replanned.step.accumulation_steps == 2
    assert replanned.predicted_peak_bytes <= budget
    assert state_bytes(ex.model) + at.peak_bytes <= budget
