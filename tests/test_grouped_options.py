"""[#44] ``fit``/``plan`` take their options grouped; the old keywords still work, warned."""

from __future__ import annotations

import inspect
import warnings

import pytest

import gradckpt
from gradckpt.api.old_keywords import as_groups
from gradckpt.testing import make


def test_fit_and_plan_have_at_most_twelve_parameters():
    assert len(inspect.signature(gradckpt.fit).parameters) <= 12
    assert len(inspect.signature(gradckpt.plan).parameters) <= 12
    for name in ("shapes", "profiling", "step"):
        assert name in inspect.signature(gradckpt.fit).parameters


def test_the_grouped_form_runs_without_a_warning():
    ex = make("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        plan = gradckpt.plan(
            ex.model, ex.loss_fn, 0.8, profiling=gradckpt.ProfileOptions(repeats=1),
            step=gradckpt.StepOptions(accumulation_steps=2),
        )  # fmt: skip
    assert plan.step is not None and plan.step.accumulation_steps == 2


def test_old_keywords_plan_the_same_with_a_deprecation_warning():
    ex = make("gpt")
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    new = gradckpt.plan(ex.model, ex.loss_fn, 0.8, profiling=gradckpt.ProfileOptions(profile=prof))
    with pytest.warns(DeprecationWarning, match=r"profiling=gradckpt\.ProfileOptions\(profile="):
        old = gradckpt.plan(ex.model, ex.loss_fn, 0.8, profile=prof)
    assert old.items == new.items


def test_a_list_of_shapes_is_the_old_form_of_shape_options():
    with (
        pytest.warns(DeprecationWarning, match=r"shapes=\[\.\.\.\], seq_dim="),
        pytest.raises(TypeError, match="model must be"),
    ):
        gradckpt.fit(None, lambda: None, 0.5, shapes=[128], seq_dim=1)  # type: ignore[arg-type]


def test_an_old_keyword_beside_its_group_joins_it():
    ex = make("gpt")
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    with pytest.warns(DeprecationWarning, match="loss_from="):
        plans = gradckpt.plan(
            ex.model, ex.loss_fn, 0.8, profiling=gradckpt.ProfileOptions(profile=prof),
            shapes=gradckpt.ShapeOptions([24]), loss_from=lambda out, *a, **k: out.sum(),
        )  # fmt: skip
    assert len(plans.entries) == 2


def test_a_group_of_the_wrong_type_is_refused():
    ex = make("gpt")
    with pytest.raises(TypeError, match="ProfileOptions"):
        gradckpt.plan(ex.model, ex.loss_fn, 0.8, profiling={"repeats": 1})  # type: ignore[arg-type]


def test_flat_options_fold_into_groups_for_the_callbacks():
    grouped = as_groups({"repeats": 1, "optimizer": "adamw", "solver": "dp", "shapes": [64]})
    assert grouped["profiling"] == gradckpt.ProfileOptions(repeats=1)
    assert grouped["step"] == gradckpt.StepOptions(optimizer="adamw")
    assert grouped["shapes"] == gradckpt.ShapeOptions([64]) and grouped["solver"] == "dp"
