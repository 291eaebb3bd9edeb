"""[#44] A verb parses the user's budget once and hands the value down.

Every reading of a budget goes through ``read_budget`` (the one parser); the
test counts its calls wherever a module bound the name, so a lower layer that
parsed the budget again would be seen.
"""

from __future__ import annotations

import sys

import pytest

import gradckpt
from gradckpt.planning.solving import budget as budget_module
from gradckpt.testing import make


@pytest.fixture
def parses(monkeypatch) -> list[object]:
    """The budgets ``read_budget`` was called with, from now on."""
    original = budget_module.read_budget
    seen: list[object] = []

    def counted(budget: object):
        seen.append(budget)
        return original(budget)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("gradckpt") and (
            getattr(module, "read_budget", None) is original
        ):
            monkeypatch.setattr(module, "read_budget", counted)
    return seen


@pytest.mark.parametrize("budget", [0.8, "50MiB", "auto"])
def test_fit_parses_its_budget_once(parses, budget):
    ex = make("gpt")
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget=budget, profiling=gradckpt.ProfileOptions(repeats=1), measure_candidates=0)
    gradckpt.remove(ex.model)
    assert parses == [budget]
    assert plan.budget_bytes is not None


def test_plan_parses_its_budget_once(parses):
    ex = make("gpt")
    gradckpt.plan(ex.model, ex.loss_fn, budget="50MiB", profiling=gradckpt.ProfileOptions(repeats=1))
    assert parses == ["50MiB"]


def test_the_count_sees_a_lower_layer_parsing_again(parses):
    ex = make("gpt")
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    gradckpt.planning.planner.Planner(prof).plan("50MiB")  # a raw budget is parsed there
    assert parses == ["50MiB"]
