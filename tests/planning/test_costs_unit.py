"""Per-op engine costs from the model's own block (issue #31), on a grid that noise
below it cannot move."""

from __future__ import annotations

import dataclasses

import pytest

from gradckpt.measure.engine_costs import EngineCosts
from gradckpt.planning.simulation.costs import engine_seconds, region_counts, steady, step_costs


def test_steady_puts_costs_on_a_grid_an_eighth_of_an_octave_apart():
    assert steady(0.0) == 0.0 and steady(-1.0) == 0.0
    assert steady(1.0) == pytest.approx(1.0)
    assert steady(1.03) == steady(0.97) == steady(1.0)  # a few percent of jitter: no change
    values = [1e-6 * 1.01**i for i in range(200)]
    for v in values:
        assert abs(steady(v) / v - 1) <= 2 ** (1 / 16) - 1 + 1e-12  # within half a step
    assert [steady(v) for v in values] == sorted(steady(v) for v in values)  # monotone


def _with_unit(prof, region: float, policy: float):
    block = next(u for u in prof.units if u.is_block and u.plannable)
    costs = EngineCosts(
        region=1e-3, recompute_op=1e-5, policy_op=1e-5, saved_tensor=1e-5, device="cpu",
        unit=block.path, unit_region=region, unit_policy=policy,
    )  # fmt: skip
    return dataclasses.replace(prof, engine_costs=costs), block


def test_a_policy_is_priced_from_the_timed_block_a_recompute_from_the_chains(zoo):
    _, prof, _ = zoo.get("gpt")
    block = next(u for u in prof.units if u.is_block and u.plannable)
    untimed = max(0.0, prof.step_time - sum(op.time for op in prof.ops)) / len(prof.ops)
    # The block's policy added 3 ms to its region's forward, however long that took;
    # a recompute is not priced from the block (a small difference of large times).
    for region in (0.1, 0.12, 0.3):
        timed, block = _with_unit(prof, region, 0.003)
        costs = step_costs(timed)
        assert costs.policy_op == pytest.approx(steady(0.003 / (block.end_op - block.first_op)))
        assert costs.recompute_op == pytest.approx(steady(1e-5 + untimed))
        assert costs.region == pytest.approx(steady(1e-3))  # per region and per tensor too
        assert costs.saved_tensor == pytest.approx(steady(1e-5))


def test_without_a_timed_block_the_chains_costs_and_untimed_work_stand(zoo):
    _, prof, _ = zoo.get("gpt")
    timed, _ = _with_unit(prof, 0.0, 0.0)
    untimed = max(0.0, prof.step_time - sum(op.time for op in prof.ops)) / len(prof.ops)
    assert step_costs(timed).recompute_op == pytest.approx(steady(1e-5 + untimed))
    assert step_costs(timed).policy_op == pytest.approx(steady(1e-5))


def test_a_policy_timed_faster_than_none_costs_nothing_not_less(zoo):
    _, prof, _ = zoo.get("gpt")
    timed, _ = _with_unit(prof, 0.1, -0.001)  # noise: the policy's forward no slower
    assert step_costs(timed).policy_op == 0.0


def _stepped(prof, engine: float):
    """The profile with its block timed as steps, the engine's part of its region ``engine``."""
    timed, block = _with_unit(prof, 0.0, 0.0)
    step, forward = 0.01, 0.004
    costs = dataclasses.replace(
        timed.engine_costs, unit_step=step, unit_forward=forward,
        unit_region_step=step + forward + engine,
    )  # fmt: skip
    return dataclasses.replace(timed, engine_costs=costs), block


def test_the_timed_block_scales_the_chains_costs_to_what_its_region_really_cost(zoo):
    # Issue #42: on real blocks (ops with weights and views) the chains' costs priced a
    # region low; the block's region step minus its plain step and forward is its real
    # engine cost, and the chains' region, tensor and per-op costs are scaled to it.
    _, prof, _ = zoo.get("gpt")
    timed, block = _stepped(prof, 0.0)
    counts = region_counts(timed, block, policy=False)
    chains = engine_seconds(counts, timed.engine_costs)
    for share in (0.8, 1.5, 2.5):
        scaled, _ = _stepped(prof, share * chains)
        costs = step_costs(scaled)
        assert costs.region == pytest.approx(steady(share * 1e-3))
        assert costs.saved_tensor == pytest.approx(steady(share * 1e-5))
    wild, _ = _stepped(prof, 40 * chains)  # a disturbed reading moves costs at most 4x
    assert step_costs(wild).region == pytest.approx(steady(4e-3))
    noise, _ = _stepped(prof, -0.001)  # a region step timed faster than plain: unscaled
    assert step_costs(noise).region == pytest.approx(steady(1e-3))


def test_a_short_block_is_timed_as_steps_at_profile_time(zoo):
    _, prof, _ = zoo.get("gpt")
    costs = prof.engine_costs
    assert costs.unit and costs.unit_step > 0 and costs.unit_forward > 0
    assert costs.unit_region_step > costs.unit_step  # its region reruns its forward
