"""The shape guard: every call checked, plans cached per shape, new shapes planned before
they run (or warned about, or refused), the budget held at every shape."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import gradckpt
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.testing import mlp


def _mlp_step(model, batch, width=64, classes=10, seed=3):
    """The training step at batch size ``batch``: loss outside the model, as in a loop."""
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, width, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    return lambda: F.cross_entropy(model(x), y)


def _ce_from(out, x):  # the loss a new shape's step computes (label values don't change memory)
    return F.cross_entropy(out, torch.zeros(len(out), dtype=torch.long))


# Above the plain peak at batch 256 (3.4 MiB), below it at 384 (4.9 MiB), above the
# least peak at 512 (3.1 MiB): the fitted shape runs plainly, larger ones need plans.
BUDGET = "4.5MiB"


def _model():
    return mlp(blocks=3, width=64, hidden=256, batch=256, dropout=0.1).model


@functools.cache
def _profile():
    """The fitted step's profile, measured once for the module (fit reuses it)."""
    model = _model()
    return gradckpt.profile(model, _mlp_step(model, 256), repeats=1)


def _fit_mlp(budget=BUDGET, **options):
    model = _model()
    plan = gradckpt.fit(
        model, _mlp_step(model, 256), budget, shapes=gradckpt.ShapeOptions(loss_from=_ce_from), profiling=gradckpt.ProfileOptions(profile=_profile()), **options
    )
    return model, plan


def test_every_call_is_guarded_not_only_the_first(peak_and_grads):
    model, _ = _fit_mlp()
    for _ in range(3):
        peak_and_grads(model, _mlp_step(model, 256))
    with torch.no_grad():  # eval calls keep nothing for backward: not guarded
        model(torch.randn(1024, 64))
    stats = gradckpt.shape_stats(model)
    assert stats.calls == 3 and stats.replans == 0 and stats.switches == 0
    peak_and_grads(model, _mlp_step(model, 384))  # the 4th call, at a new shape, is still seen
    stats = gradckpt.shape_stats(model)
    assert stats.calls == 4 and stats.replans == 1 and stats.plans == 2
    assert "batch" not in stats.active and "(384,64):float32" in stats.active


def test_known_shapes_switch_from_the_cache_new_ones_are_planned_once(peak_and_grads):
    model, _ = _fit_mlp()
    for batch in (384, 256, 384, 512, 256, 512):
        peak_and_grads(model, _mlp_step(model, batch))
    stats = gradckpt.shape_stats(model)
    assert stats.replans == 2  # 384 and 512: misses; every later call of them hits the cache
    assert stats.plans == 3 and stats.switches == 6
    assert len(stats.replan_seconds) == 2 and all(t > 0 for t in stats.replan_seconds)
    assert "2 planned during training" in stats.summary()


def test_replanned_shape_holds_the_budget_and_its_prediction_is_the_measured_peak(peak_and_grads):
    model, plan = _fit_mlp()
    for batch in (384, 512):
        peak, _ = peak_and_grads(model, _mlp_step(model, batch))
        active = gradckpt.applied_plan(model)
        assert active is not plan
        assert peak == active.predicted_peak_bytes  # fake-profiled at the new shape, exact
        assert peak <= plan.budget_bytes


def test_warn_runs_the_old_plan_with_one_warning_naming_budget_and_predicted_peak(peak_and_grads):
    model, plan = _fit_mlp(on_new_shape="warn")
    with pytest.warns(UserWarning, match="on_new_shape='warn'") as caught:
        peak, _ = peak_and_grads(model, _mlp_step(model, 1024))
    [message] = [
        str(w.message) for w in caught if "gradckpt: the model was called" in str(w.message)
    ]
    assert gradckpt.applied_plan(model) is plan  # the old plan ran
    assert f"{peak / 2**20:.2f} MiB" in message  # predicted peak there = what it measured
    assert f"budget of {plan.budget_bytes / 2**20:.2f} MiB" in message
    assert peak > plan.budget_bytes  # the case a warning is for
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per shape
        peak_and_grads(model, _mlp_step(model, 1024))
    assert gradckpt.shape_stats(model).warnings == 1


def test_error_policy_raises_before_running_and_leaves_the_model_usable(peak_and_grads):
    model, plan = _fit_mlp(on_new_shape="error")
    plain_peak, plain_grads = peak_and_grads(model, _mlp_step(model, 256))
    with pytest.raises(gradckpt.ShapeError, match=r"\(384,64\):float32.*plans only for"):
        peak_and_grads(model, _mlp_step(model, 384))
    assert all(p.grad is None for p in model.parameters())
    assert gradckpt.applied_plan(model) is plan
    peak, grads = peak_and_grads(model, _mlp_step(model, 256))
    assert peak == plain_peak and all(torch.equal(grads[k], plain_grads[k]) for k in grads)


def test_infeasible_new_shape_raises_budget_error_before_running_and_model_stays_usable(
    peak_and_grads,
):
    model, plan = _fit_mlp()
    before, before_grads = peak_and_grads(model, _mlp_step(model, 256))
    with pytest.raises(gradckpt.BudgetError, match=r"\(16384,64\):float32.*nothing ran") as info:
        peak_and_grads(model, _mlp_step(model, 16384))
    assert info.value.least_peak_bytes > plan.budget_bytes
    assert all(p.grad is None for p in model.parameters())
    assert gradckpt.applied_plan(model) is plan
    assert gradckpt.shape_stats(model).plans == 1
    after, after_grads = peak_and_grads(model, _mlp_step(model, 256))
    assert after == before and all(
        torch.equal(after_grads[k], before_grads[k]) for k in after_grads
    )


def test_applying_fits_plan_again_keeps_its_guard_and_remove_ends_it(peak_and_grads):
    model, plan = _fit_mlp()
    gradckpt.apply(model, plan)  # fit's own plan again: the guard (and re-planning) stays
    assert gradckpt.shape_stats(model).policy == "replan"
    peak_and_grads(model, _mlp_step(model, 384))
    assert gradckpt.shape_stats(model).replans == 1
    gradckpt.remove(model)
    assert gradckpt.shape_stats(model) is None
    assert gradckpt.applied_plan(model) is None and "forward" not in model.__dict__


def test_on_new_shape_is_validated():
    ex = mlp(blocks=2)
    with pytest.raises(ValueError, match="on_new_shape must be one of"):
        gradckpt.fit(ex.model, ex.loss_fn, 0.8, shapes=gradckpt.ShapeOptions(on_new_shape="ignore"))
    assert gradckpt.applied_plan(ex.model) is None


def test_preplanned_shapes_switch_without_planning(peak_and_grads):
    model = _model()
    x384, x512 = torch.randn(384, 64), torch.randn(512, 64)
    gradckpt.fit(
        model, _mlp_step(model, 256), BUDGET, shapes=gradckpt.ShapeOptions([(x384,), x512], loss_from=_ce_from), profiling=gradckpt.ProfileOptions(profile=_profile()), )  # fmt: skip
    assert gradckpt.shape_stats(model).plans == 3
    for batch in (384, 512, 256):
        peak, _ = peak_and_grads(model, _mlp_step(model, batch))
        assert peak == gradckpt.applied_plan(model).predicted_peak_bytes
    stats = gradckpt.shape_stats(model)
    assert stats.replans == 0 and stats.switches == 3


def test_step_that_never_calls_the_model_forward_is_fitted_unguarded_with_a_warning():
    """A trainer's step may call the model's parts, never ``model(...)`` itself (Lightning's
    ``training_step`` calling ``self.model``'s layers): there is no call to guard, so
    ``fit`` says so and applies the plan made for this batch, with plain gradients."""
    model = mlp(blocks=4, width=64, batch=128).model
    x = torch.randn(128, 64)

    def step():  # runs the parts one by one, as the model's forward would: it never runs
        h = model.inp(x)
        for block in model.blocks:
            h = block(h)
        return model.head(h).square().mean()

    torch.manual_seed(1)
    step().backward()
    plain = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="never called .* own forward"):
        plan = gradckpt.fit(model, step, budget=0.8, measure_candidates=0)
    assert gradckpt.applied_plan(model) is plan
    assert gradckpt.shape_stats(model) is None or gradckpt.shape_stats(model).plans <= 1
    torch.manual_seed(1)
    with AllocatorTracker() as allocator:
        step().backward()
    assert state_bytes(model) + allocator.peak_bytes <= plan.budget_bytes  # no segment was planned that cannot open
    for k, p in model.named_parameters():
        assert torch.equal(p.grad, plain[k]), k
    with pytest.raises(ValueError, match="never called"):
        gradckpt.plan(model, step, budget=0.8, shapes=gradckpt.ShapeOptions([32]))
