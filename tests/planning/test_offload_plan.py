"""Offload plans on the zoo: exact gradients, peaks and host bytes as predicted, budgets held.

Run with the host-copy backend (CPU): the moved bytes leave the compute pool
for memory outside torch's allocator, so the allocator's peak is the device
peak and the backend's count is the host's. Timing is simulated from the
stated bandwidth.
"""

from __future__ import annotations

import pytest

import gradckpt
from gradckpt.apply.apply import applied_units
from gradckpt.engine.offload.runtime import OffloadRuntime
from gradckpt.planning import Plan, UnitChoice, simulate
from gradckpt.planning.kinds.offload.sim import offload_effect
from gradckpt.planning.kinds.offload.solve import solve_offload
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.solving.solvers import least_peak_plan, solve_dp

from .conftest import ZOO_NAMES, assert_same_step, run_step

OPTIONS = OffloadOptions(min_bytes=1024)


def _offload_blocks(prof, options=OPTIONS, skip_last: bool = False) -> Plan:
    blocks = [u.path for u in prof.units if u.plannable and u.is_block]
    chosen = set(blocks[:-1] if skip_last else blocks)
    items = tuple(
        UnitChoice(u.path, "offload" if u.path in chosen else "keep")
        for u in prof.units if u.plannable
    )  # fmt: skip
    return Plan(items, prof.fingerprint, offload=options)


def _run_applied(ex, plan):
    gradckpt.apply(ex.model, plan)
    try:
        step = run_step(ex)
        sessions = {id(s.runtime.session): s.runtime.session for s in
                    applied_units(ex.model).values() if isinstance(s.runtime, OffloadRuntime)}  # fmt: skip
    finally:
        gradckpt.remove(ex.model)
    (session,) = sessions.values()
    return step, session


@pytest.mark.parametrize("name", ZOO_NAMES)
@pytest.mark.parametrize("skip_last", [False, True])
def test_offloaded_blocks_match_the_plain_step_and_the_prediction(zoo, name, skip_last):
    ex, prof, plain = zoo.get(name)
    plan = _offload_blocks(prof, skip_last=skip_last)
    pred = simulate(prof, plan)
    step, session = _run_applied(ex, plan)
    assert_same_step(plain, step)  # bit-equal loss, gradients and buffers (dropout on)
    assert step.peak <= pred.peak_bytes  # at the allocator
    assert step.peak >= 0.99 * pred.peak_bytes
    assert session.backend.peak_host_bytes == pred.host_bytes > 0
    assert session.backend.host_bytes == 0  # all handed back after backward


def test_moving_saved_tensors_lowers_the_measured_peak(zoo):
    ex, prof, plain = zoo.get("gpt")
    step, _ = _run_applied(ex, _offload_blocks(prof))
    assert step.peak < plain.peak


def test_prefetch_can_raise_the_peak_and_the_simulator_sees_it(zoo):
    ex, prof, plain = zoo.get("gpt")
    ahead = _offload_blocks(prof)
    late = _offload_blocks(prof, OffloadOptions(min_bytes=1024, prefetch=False))
    assert simulate(prof, ahead).peak_bytes >= simulate(prof, late).peak_bytes
    for plan in (ahead, late):
        step, _ = _run_applied(ex, plan)
        assert_same_step(plain, step)
        assert step.peak == pytest.approx(simulate(prof, plan).peak_bytes, rel=0.01)


def test_a_slow_link_costs_stall_and_prefetch_hides_some_of_it(zoo):
    _, prof, _ = zoo.get("gpt")
    moved = simulate(prof, _offload_blocks(prof)).host_bytes
    # A link so slow that each block's copy (a quarter of the bytes) takes as long as
    # all the step's profiled compute: no window can hide it.
    rate = moved / (4 * sum(op.time for op in prof.ops))
    slow = dict(d2h_bandwidth=rate, h2d_bandwidth=rate, min_bytes=1024)
    ahead = simulate(prof, _offload_blocks(prof, OffloadOptions(**slow)))
    late = simulate(prof, _offload_blocks(prof, OffloadOptions(**slow, prefetch=False)))
    assert late.offload_stall > ahead.offload_stall > 0
    fast = simulate(prof, _offload_blocks(prof, OffloadOptions(d2h_bandwidth=1e15,
                                                              h2d_bandwidth=1e15)))  # fmt: skip
    assert fast.offload_stall < ahead.offload_stall
    assert ahead.step_time == pytest.approx(prof.step_time + ahead.offload_stall + ahead.engine_time)


def test_the_last_offloaded_unit_is_held_into_backward(zoo):
    _, prof, _ = zoo.get("gpt")
    effect = offload_effect(prof, _offload_blocks(prof), OPTIONS)
    assert [m.held for m in effect.units] == [False] * (len(effect.units) - 1) + [True]


@pytest.mark.parametrize("name", ["gpt", "resnet", "unet"])
def test_planned_with_offload_fits_the_budget_and_gives_exact_gradients(zoo, name, no_chunking):
    ex, prof, plain = zoo.get(name)
    _, least = least_peak_plan(prof)
    budget = (least.peak_bytes + prof.measured_peak_bytes) // 2  # between least and plain
    plan = solve_offload(prof, budget, OPTIONS)
    step, _ = _run_applied(ex, plan) if any(u.mode == "offload" for u in plan.units) else (
        None, None)  # fmt: skip
    if step is None:
        gradckpt.apply(ex.model, plan)
        step = run_step(ex)
        gradckpt.remove(ex.model)
    assert_same_step(plain, step)
    assert plan.predicted_peak_bytes <= budget
    assert step.peak <= budget


def test_gpt_at_eighty_percent_offloads_and_is_faster_than_recompute(zoo, no_chunking):
    # Without chunking: a chunked linear head frees this much for no recompute at all.
    _, prof, _ = zoo.get("gpt")
    budget = int(0.8 * prof.measured_peak_bytes)
    with_offload = solve_offload(prof, budget, OPTIONS)
    without = solve_dp(prof, budget)
    assert any(u.mode == "offload" for u in with_offload.units)
    assert with_offload.predicted_step_time < without.predicted_step_time


def test_host_budget_is_held_by_the_plan_and_by_the_run(zoo, no_chunking):
    ex, prof, plain = zoo.get("gpt")
    budget = int(0.8 * prof.measured_peak_bytes)
    free = simulate(prof, solve_offload(prof, budget, OPTIONS)).host_bytes
    limit = free * 3 // 4  # room for three of the four blocks
    plan = solve_offload(prof, budget, OffloadOptions(min_bytes=1024, host_budget=limit))
    pred = simulate(prof, plan)
    assert 0 < pred.host_bytes <= limit
    assert pred.peak_bytes <= budget
    assert pred.step_time <= solve_dp(prof, budget).predicted_step_time
    step, session = _run_applied(ex, plan)
    assert_same_step(plain, step)
    assert session.backend.peak_host_bytes == pred.host_bytes
    assert step.peak <= budget


def test_offload_never_makes_the_plan_slower(zoo):
    _, prof, _ = zoo.get("resnet")
    for share in (0.7, 0.85, 0.95):
        budget = int(share * prof.measured_peak_bytes)
        assert (
            solve_offload(prof, budget, OPTIONS).predicted_step_time
            <= solve_dp(prof, budget).predicted_step_time
        )


def test_offload_plan_round_trips_json(zoo, tmp_path):
    _, prof, _ = zoo.get("gpt")
    plan = solve_offload(prof, int(0.8 * prof.measured_peak_bytes), OPTIONS)
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded == plan and loaded.offload == OPTIONS


def test_summary_and_explain_say_what_moves_and_when(zoo):
    _, prof, _ = zoo.get("gpt")
    plan = _offload_blocks(prof)
    text = plan.summary()
    assert "offload: 4 unit(s) to host memory over 25 GB/s" in text
    assert "blocks.0                     offload    saved tensors out after its forward" in text
    assert "back when blocks.1's backward begins" in text
    assert "blocks.3                     offload    saved tensors copied out" in text
    explanation = gradckpt.explain(prof, plan=plan)
    moved = [r for r in explanation.rows if r.status == "offloaded"]
    effect = offload_effect(prof, plan, plan.offload)
    assert sum(r.nbytes for r in moved) == sum(m.nbytes for m in effect.units if not m.held)
    assert "offloaded to host after blocks.0's forward, back at blocks.1's backward" in {
        r.why for r in moved
    }
    decisions = {u.path: u.decision for u in explanation.units}
    assert decisions["blocks.0"].startswith("offload ")
    assert "back at blocks.1 backward" in decisions["blocks.0"]
