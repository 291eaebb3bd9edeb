"""A byte budget that holds the step's tensors but not what malloc holds beside them is
planned for the tensors alone, said with a warning of its own category (so a user or a
benchmark can filter it, or make it an error)."""

from __future__ import annotations

import warnings

import pytest

import gradckpt
from gradckpt.measure import TensorsOnlyWarning
from gradckpt.measure.beside import malloc_in_use, warn_tensors_only
from gradckpt.planning.planner import Planner
from gradckpt.testing import make


def test_the_warning_names_the_budget_that_holds_both():
    with pytest.warns(TensorsOnlyWarning, match=r"5\.00 MiB holds both"):
        warn_tensors_only(4 << 20, 5 << 20)
    assert issubclass(TensorsOnlyWarning, UserWarning)  # filters on UserWarning still see it


@pytest.mark.skipif(malloc_in_use() is None, reason="malloc's bytes need glibc")
def test_fit_at_the_tensors_least_peak_warns_and_holds_the_tensors(one_thread):
    ex = make("gpt")
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    _, least = Planner(prof, chunking=False).least_peak()
    with pytest.warns(TensorsOnlyWarning):
        plan = gradckpt.fit(
            ex.model, ex.loss_fn, least.peak_bytes, measure_candidates=0, chunking=False,
            profiling=gradckpt.ProfileOptions(profile=prof),
        )  # fmt: skip
    gradckpt.remove(ex.model)
    assert plan.predicted_peak_bytes <= least.peak_bytes
    # Made an error, the same call refuses instead of planning for the tensors alone.
    with warnings.catch_warnings():
        warnings.simplefilter("error", TensorsOnlyWarning)
        with pytest.raises(TensorsOnlyWarning):
            gradckpt.fit(
                ex.model, ex.loss_fn, least.peak_bytes, measure_candidates=0, chunking=False,
                profiling=gradckpt.ProfileOptions(profile=prof),
            )  # fmt: skip
    assert gradckpt.applied_plan(ex.model) is None  # refused before anything was put on
