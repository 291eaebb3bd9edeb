"""Folding the training step into a profile: resident bytes, transient gradients, the floor."""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.measure import optimizer_memory
from gradckpt.planning.solving.baselines import none_plan
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.step_phases import step_parts
from gradckpt.planning.solving.whole_step import optimizer_phase_bytes, with_training_step
from gradckpt.profiling.records import NEVER, Profile
from gradckpt.profiling.training_step import TrainingStep
from gradckpt.testing import make


@pytest.fixture(scope="module")
def gpt() -> tuple:
    ex = make("gpt", layers=3, d_model=64, seq=32, batch=2)
    return ex, gradckpt.profile(ex.model, ex.loss_fn, repeats=1)


def test_the_profile_knows_which_storages_are_the_gradients(gpt):
    ex, prof = gpt
    params = {p.untyped_storage().data_ptr(): p for p in ex.model.parameters()}  # tied: once
    assert prof.grad_bytes == sum(p.untyped_storage().nbytes() for p in params.values())
    assert all(prof.storages[i].free == NEVER for i in prof.grad_storages)  # alive at the end


def test_a_fake_profile_knows_them_too(gpt):
    ex, prof = gpt
    fake = gradckpt.profile(ex.model, ex.loss_fn, fake=True)
    assert fake.grad_bytes == prof.grad_bytes


def test_accumulation_holds_every_gradient_and_makes_each_new_one_transient(gpt):
    ex, prof = gpt
    step = TrainingStep(optimizer_memory(ex.model, "adamw"), accumulation_steps=4)
    whole = with_training_step(prof, step)
    assert whole.resident_bytes == prof.grad_bytes + step.optimizer.state_bytes
    for i in prof.grad_storages:
        assert whole.storages[i].free == prof.storages[i].alloc + 1
    assert whole.floor_bytes == optimizer_phase_bytes(prof, step) > prof.param_bytes
    plain = none_plan(prof)
    # Resident gradients raise the plain peak by at most what backward had not made yet.
    raised = gradckpt.simulate(whole, plain).peak_bytes - gradckpt.simulate(prof, plain).peak_bytes
    assert step.optimizer.state_bytes < raised <= step.optimizer.state_bytes + prof.grad_bytes


def test_without_accumulation_only_the_state_is_resident(gpt):
    ex, prof = gpt
    step = TrainingStep(optimizer_memory(ex.model, "sgd"))
    whole = with_training_step(prof, step)
    assert whole.resident_bytes == step.optimizer.state_bytes == 0  # SGD without momentum
    assert whole.storages == prof.storages
    zeroed = with_training_step(prof, TrainingStep(None, set_to_none=False))
    assert zeroed.resident_bytes == prof.grad_bytes


def test_folding_is_idempotent_and_refuses_another_step(gpt):
    _ex, prof = gpt
    step = TrainingStep(None, accumulation_steps=2)
    whole = with_training_step(prof, step)
    assert with_training_step(whole, step) is whole
    assert with_training_step(prof, None) is prof
    with pytest.raises(ValueError, match="already counts a training step"):
        with_training_step(whole, TrainingStep(None, accumulation_steps=3))


def test_parts_add_up_to_the_predicted_peak(gpt):
    ex, prof = gpt
    for step in (TrainingStep(optimizer_memory(ex.model, "adamw")),
                 TrainingStep(optimizer_memory(ex.model, "adamw"), accumulation_steps=4)):  # fmt: skip
        whole = with_training_step(prof, step)
        for plan in (none_plan(whole), gradckpt.Planner(whole).least_peak()[0]):
            pred = gradckpt.simulate(whole, plan)
            parts = step_parts(whole, pred)
            assert parts.total == pred.peak_bytes
            assert parts.optimizer_state == step.optimizer.state_bytes
            assert parts.phase.startswith("forward/backward") or parts.activations == 0


def test_the_optimizer_step_can_set_the_peak():
    # A wide model with a tiny batch: parameters dominate, so Adam's step is the peak.
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
    x = torch.randn(2, 512)
    prof = gradckpt.profile(model, lambda: model(x).sum(), repeats=1, blocks=["0", "1", "2"])
    whole = with_training_step(prof, TrainingStep(optimizer_memory(model, "adamw")))
    plan = gradckpt.Planner(whole).plan(whole.measured_peak_bytes)
    assert plan.step.phase == "optimizer step"
    assert plan.predicted_peak_bytes == whole.floor_bytes
    assert "optimizer step temporaries" in plan.summary()


def test_budget_errors_name_what_no_plan_lowers(gpt):
    ex, prof = gpt
    whole = with_training_step(prof, TrainingStep(optimizer_memory(ex.model, "adamw")))
    state = whole.step.state_bytes
    with pytest.raises(BudgetError, match=r"parameters \(.*\) and the optimizer state") as err:
        gradckpt.Planner(whole).plan(prof.param_bytes + state - 1)
    assert "\n" not in str(err.value)
    with pytest.raises(BudgetError, match="the optimizer step alone peaks at"):
        gradckpt.Planner(whole).plan(whole.floor_bytes - 1)


def test_json_keeps_the_step(gpt, tmp_path):
    ex, prof = gpt
    whole = with_training_step(prof, TrainingStep(optimizer_memory(ex.model, "adam"), 2, False))
    whole.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again == whole
    plan = gradckpt.Planner(whole).plan(whole.measured_peak_bytes)
    plan.save(tmp_path / "plan.json")
    assert gradckpt.Plan.load(tmp_path / "plan.json").step == plan.step


def test_the_summary_says_when_the_optimizer_is_not_counted(gpt):
    _ex, prof = gpt
    plan = gradckpt.Planner(prof).plan(prof.measured_peak_bytes)
    assert plan.step is None
    assert "optimizer is NOT counted" in plan.summary()
