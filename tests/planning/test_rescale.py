"""Rescaling a profile to a new sequence length: exact against fake profiles at unseen
lengths (GPT-2, Llama), refused when the step is not polynomial in the length."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import gradckpt
from gradckpt.api.model_calls import length_of
from gradckpt.planning.plans.planset import shape_key
from gradckpt.planning.solving.rescale import fit_length_scaling

pytest.importorskip("transformers")
from gradckpt.integrations.hf.zoo import hf_example


def _unused_loss():  # plan(profile=...) plans from the profile; the loss is not run
    raise AssertionError("not called")


def _profiler(name):
    ex = hf_example(name, layers=2, hidden=64, heads=4, seq=256, batch=2, vocab=128)
    model = ex.model
    model.config.use_cache = False
    ids = ex.inputs["input_ids"]

    def at(n):
        batch = {"input_ids": ids[:, :n], "labels": ids[:, :n]}
        return gradckpt.profile(model, lambda: model(**batch).loss, fake=True)

    return model, at


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_rescaled_profile_equals_the_fake_profile_at_unseen_lengths(name):
    model, at = _profiler(name)
    scaling = fit_length_scaling({n: at(n) for n in (32, 48, 64, 80)})
    assert scaling is not None
    for n in (7, 100, 256):
        real, scaled = at(n), scaling.at(n)
        assert [s.nbytes for s in scaled.storages] == [s.nbytes for s in real.storages]
        assert [op.flops for op in scaled.ops] == [op.flops for op in real.ops]
        assert scaled.measured_peak_bytes == real.measured_peak_bytes
        assert scaled.step_time == pytest.approx(real.step_time, rel=1e-9)
        try:
            gradckpt.plan(model, _unused_loss, 1, profiling=gradckpt.ProfileOptions(profile=scaled))
        except gradckpt.BudgetError as exc:  # halfway between the least and the plain peak
            budget = (exc.least_peak_bytes + real.measured_peak_bytes) // 2
        plan = gradckpt.plan(model, _unused_loss, budget, profiling=gradckpt.ProfileOptions(profile=scaled))
        assert gradckpt.simulate(real, plan).peak_bytes == plan.predicted_peak_bytes <= budget


def test_a_step_that_is_not_polynomial_in_the_length_is_refused():
    _, at = _profiler("gpt2")
    profiles = {n: at(n) for n in (32, 48, 64, 80)}
    assert fit_length_scaling(profiles) is not None
    assert fit_length_scaling({n: profiles[n] for n in (32, 48, 64)}) is None  # no check point
    odd = profiles[80]
    bumped = replace(odd.storages[5], nbytes=odd.storages[5].nbytes + 4)  # off the polynomial
    broken = replace(odd, storages=(*odd.storages[:5], bumped, *odd.storages[6:]))
    assert fit_length_scaling({**profiles, 80: broken}) is None
    other_line = replace(odd, ops=odd.ops[:-1])  # a different event line
    assert fit_length_scaling({**profiles, 80: other_line}) is None


def test_length_of_accepts_only_a_change_of_the_sequence_length():
    def key(*shapes):
        return shape_key(
            (), {f"t{i}": torch.zeros(s, dtype=torch.long) for i, s in enumerate(shapes)}
        )

    assert length_of(key((2, 64), (2, 64)), key((2, 96), (2, 96)), 1) == (64, 96)
    assert length_of(key((2, 64), (2, 7)), key((2, 96), (2, 7)), 1) == (64, 96)
    assert length_of(key((2, 64)), key((3, 64)), 1) is None  # the batch changed
    assert length_of(key((2, 64), (2, 64)), key((2, 96), (2, 80)), 1) is None
    assert length_of(key((2, 64)), key((2, 64), (2, 64)), 1) is None
    assert length_of(key((2, 64)), key((2, 64)), 1) is None  # nothing changed
