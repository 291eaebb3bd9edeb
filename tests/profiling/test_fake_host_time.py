"""A fake profile for a GPU states the host's time per op it assumed, and the plan says it.

Roofline times alone make a short op on a GPU nearly free; the host still takes a
few microseconds to issue it, which is what a step (and a recompute) of short
ops costs there (issue #42). This torch build has no CUDA, so the fake profile
is made on the CPU and its times estimated for "cuda", as a CUDA build would.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gradckpt
from gradckpt.measure.engine_costs import engine_costs
from gradckpt.planning import Plan
from gradckpt.profiling.fake import with_estimated_times
from gradckpt.testing import make

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def fake_cpu():
    ex = make("gpt", layers=4, d_model=64, heads=4, seq=32, vocab=256, batch=2, dropout=0.0)
    return ex, gradckpt.profile(ex.model, ex.loss_fn, fake=True)


def test_no_op_costs_less_than_the_stated_host_time(fake_cpu):
    _, prof = fake_cpu
    assert prof.host_op_seconds == 0.0  # a CPU profile assumes none
    gpu = with_estimated_times(prof, CUDA, host_op_seconds=8e-6)
    assert gpu.host_op_seconds == 8e-6 and gpu.device == "cuda"
    assert min(op.time for op in gpu.ops) == pytest.approx(8e-6)
    assert gpu.step_time >= 8e-6 * len(gpu.ops)
    roofline = with_estimated_times(prof, CUDA, host_op_seconds=0.0)
    assert roofline.step_time < gpu.step_time  # short ops: the host sets the step


def test_by_default_the_host_time_is_this_machine_s_and_the_engine_is_priced_here(fake_cpu):
    _, prof = fake_cpu
    gpu = with_estimated_times(prof, CUDA)
    here = engine_costs("cpu")
    assert gpu.host_op_seconds == here.host_op > 0
    assert gpu.engine_costs == dataclasses.replace(here, device="cuda")
    with pytest.raises(ValueError, match="host_op_seconds"):
        with_estimated_times(prof, CUDA, host_op_seconds=-1.0)


def test_a_plan_from_it_states_the_assumption_and_keeps_it_through_json(fake_cpu, tmp_path):
    ex, prof = fake_cpu
    gpu = with_estimated_times(prof, CUDA, host_op_seconds=5e-6)
    plan = gradckpt.plan(ex.model, ex.loss_fn, budget=gpu.measured_peak_bytes, profiling=gradckpt.ProfileOptions(profile=gpu))
    assert plan.host_op_seconds == 5e-6
    assert "at least 5.0 us of host time per op assumed" in plan.summary()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).host_op_seconds == 5e-6
    measured = gradckpt.plan(ex.model, ex.loss_fn, budget=1.0)
    assert measured.host_op_seconds is None and "host time per op" not in measured.summary()


def test_profiles_rescaled_in_length_keep_the_host_time(fake_cpu):
    from fractions import Fraction

    from gradckpt.planning.solving.rescale import LengthScaling

    _, prof = fake_cpu
    gpu = with_estimated_times(prof, CUDA, host_op_seconds=8e-6)

    def constant(n: int) -> tuple[Fraction, Fraction, Fraction]:
        return (Fraction(n), Fraction(0), Fraction(0))

    scaling = LengthScaling(
        gpu, (32,), tuple(constant(s.nbytes) for s in gpu.storages),
        tuple(constant(op.flops) for op in gpu.ops),
    )  # fmt: skip
    at = scaling.at(64)
    assert at is not None and at.host_op_seconds == 8e-6
    assert min(op.time for op in at.ops) == pytest.approx(8e-6)
    assert at.step_time == pytest.approx(gpu.step_time)  # the same sizes: the same times
