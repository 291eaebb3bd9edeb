"""Bad arguments to the public API: one clear error, in the user's terms, before any profiling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.planning.solving.budget import parse_budget
from gradckpt.profiling import ProfileError
from gradckpt.testing import make


@pytest.fixture
def counted():
    """A small model and a loss_fn that counts its calls (profiling calls it)."""
    ex = make("mlp", blocks=2, width=16, hidden=32, batch=4)
    calls: list[int] = []

    def loss_fn():
        calls.append(1)
        return ex.loss_fn()

    return ex.model, loss_fn, calls


BAD_OPTIONS = [
    ({"profile": "x"}, TypeError, ["profile=", "gradckpt.profile("]),
    ({"blocks": 42}, TypeError, ["blocks=", "42"]),
    ({"repeats": "three"}, TypeError, ["repeats=", "'three'"]),
    ({"repeats": 0}, ValueError, ["repeats=", "at least 1"]),
    ({"solver": "fastest"}, ValueError, ["solver", "fastest"]),
    ({"segments": "no"}, TypeError, ["segments="]),
]


@pytest.mark.parametrize(("options", "error", "fragments"), BAD_OPTIONS)
@pytest.mark.parametrize("verb", ["plan", "fit"])
def test_bad_api_arguments_are_refused_before_profiling(counted, verb, options, error, fragments):
    model, loss_fn, calls = counted
    with pytest.raises(error) as info:
        getattr(gradckpt, verb)(model, loss_fn, 0.5, **options)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert calls == []  # nothing ran
    assert gradckpt.applied_plan(model) is None


@pytest.mark.parametrize("budget", ["lots", "150%", "2.5", -3, 1.5, None, [1]])
def test_bad_budget_is_refused_before_profiling(counted, budget):
    model, loss_fn, calls = counted
    with pytest.raises((ValueError, TypeError)):
        gradckpt.plan(model, loss_fn, budget)
    assert calls == []


def test_budget_messages_use_the_users_words():
    with pytest.raises(ValueError, match="150%") as info:
        parse_budget("150%", 1000)
    assert "the float 1.5" not in str(info.value)
    with pytest.raises(ValueError, match=r"'2\.5'.*unit"):
        parse_budget("2.5", 1000)  # not 2 bytes


def test_numpy_numbers_are_budgets():
    assert parse_budget(np.int64(4096), 0) == 4096
    assert parse_budget(np.float64(0.5), 1000) == 500


def test_loss_fn_that_is_not_callable_or_model_that_is_not_a_module():
    with pytest.raises(TypeError, match="loss_fn"):
        gradckpt.plan(nn.Linear(2, 2), "loss", 0.5)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        gradckpt.plan("model", lambda: None, 0.5)


def test_apply_and_remove_refuse_what_is_not_a_model():
    ex = make("mlp", blocks=2, width=16, hidden=32, batch=4)
    plan = gradckpt.plan(ex.model, ex.loss_fn, 1.0, profiling=gradckpt.ProfileOptions(repeats=1))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        gradckpt.apply("model", plan)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        gradckpt.remove("model")
    with pytest.raises(TypeError, match=r"gradckpt\.Plan"):
        gradckpt.apply(ex.model, "plan.json")


def test_loss_fn_that_calls_backward_itself_is_told_so():
    ex = make("mlp", blocks=2, width=16, hidden=32, batch=4)

    def loss_fn():
        loss = ex.loss_fn()
        loss.backward()
        return loss

    def loss_fn_returning_nothing():
        ex.loss_fn().backward()

    for fn in (loss_fn, loss_fn_returning_nothing):
        with pytest.raises(ProfileError, match=r"backward\(\) itself"):
            gradckpt.plan(ex.model, fn, 0.5, profiling=gradckpt.ProfileOptions(repeats=1))
        assert all(p.grad is None for p in ex.model.parameters())


def test_model_with_nothing_to_checkpoint_suggests_blocks():
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return (x @ self.w).relu() @ self.w

    model = Flat()
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="blocks="):
        gradckpt.plan(model, lambda: model(x).sum(), 0.5, profiling=gradckpt.ProfileOptions(repeats=1))


def test_loss_from_that_cannot_take_the_models_arguments_is_refused_at_fit(counted):
    model, loss_fn, _ = counted
    with pytest.raises(TypeError, match=r"loss_from\(output, \*args, \*\*kwargs\)"):
        gradckpt.fit(model, loss_fn, 1.0, shapes=gradckpt.ShapeOptions([8], loss_from=lambda output: output.sum()))
    assert gradckpt.applied_plan(model) is None
    with pytest.raises(TypeError, match="loss_from= takes a callable"):
        gradckpt.fit(model, loss_fn, 1.0, shapes=gradckpt.ShapeOptions(loss_from="loss"))
