"""BudgetError's least peak: what the solver really reaches, the same on every run, usable as a budget."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest

import gradckpt
from gradckpt.planning.solve import solve
from gradckpt.planning.solving.budget import BudgetError, parse_budget
from gradckpt.planning.solving.solvers import finish, none_plan

from .conftest import ZOO_NAMES


def _noisy(prof, seed):
    """The same step, its op times as a busy machine might measure them (up to 10x off)."""
    rng = random.Random(seed)
    ops = tuple(replace(op, time=op.time * rng.uniform(0.1, 10.0)) for op in prof.ops)
    return replace(prof, ops=ops)


def _least(prof, segments=True):
    with pytest.raises(BudgetError) as info:
        solve(prof, 1, "dp", segments=segments)
    return info.value


@pytest.fixture(scope="module")
def llama_profile():
    pytest.importorskip("transformers")
    from gradckpt.integrations.hf.zoo import hf_example

    ex = hf_example("llama")
    return gradckpt.profile(ex.model, ex.loss_fn, repeats=1)


@pytest.mark.parametrize("name", [*ZOO_NAMES, "hf-llama"])
def test_least_peak_in_budget_error_is_the_same_whatever_the_op_times(zoo, name, request):
    prof = request.getfixturevalue("llama_profile") if name == "hf-llama" else zoo.get(name)[1]
    stated = {_least(_noisy(prof, seed)).least_peak_bytes for seed in range(12)}
    assert len(stated) == 1, f"{name}: least peaks {sorted(stated)}"


@pytest.mark.parametrize("name", ZOO_NAMES)
@pytest.mark.parametrize("segments", [True, False])
def test_least_peak_is_never_above_plain_and_works_as_a_budget(zoo, name, segments):
    _, prof, _ = zoo.get(name)
    for seed in range(2):
        noisy = _noisy(prof, seed)
        error = _least(noisy, segments)
        _, plain = finish(noisy, none_plan(noisy), None, "none")
        assert error.least_peak_bytes <= plain.peak_bytes
        plan = solve(noisy, error.least_peak_bytes, "dp", segments=segments)
        assert plan.predicted_peak_bytes <= error.least_peak_bytes


@pytest.mark.parametrize("name", ["gpt", "unet"])
def test_least_peak_as_written_in_the_message_works_as_a_budget(zoo, name):
    ex, prof, _ = zoo.get(name)
    error = _least(prof)
    written = re.search(r"least peak[^0-9]*([0-9][0-9,.]* ?[KMG]?i?B)", str(error)).group(1)
    budget = written.replace(",", "")
    plan = gradckpt.plan(ex.model, ex.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof))
    # The message rounds up: a plan between the least peak and that is as good an answer.
    assert plan.predicted_peak_bytes <= parse_budget(budget, prof.measured_peak_bytes)
