"""The solver's tie (issue #31): what a change to the DP's plan must save to be made."""

from __future__ import annotations

from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving import solvers
from gradckpt.planning.solving.chain import build_chain, with_engine_costs
from gradckpt.planning.solving.polish import polish


def _every_block_recomputed(prof):
    plan = solvers.every_kth_plan(prof, 1)
    return plan, simulate(prof, plan)


def test_polish_takes_a_move_only_when_it_saves_more_than_the_tie(zoo):
    _, prof, _ = zoo.get("gpt")
    model = with_engine_costs(build_chain(prof), prof)
    plan, pred = _every_block_recomputed(prof)
    # With room for everything, keeping blocks saves their recompute: polish moves.
    moved, moved_pred = polish(prof, plan, prof.measured_peak_bytes * 2, model, pred)
    assert moved.items != plan.items and moved_pred.step_time < pred.step_time
    saved = pred.step_time - moved_pred.step_time
    # A tie larger than all the moves could save: the plan stays as it is.
    kept, kept_pred = polish(prof, plan, prof.measured_peak_bytes * 2, model, pred, tie=saved)
    assert kept.items == plan.items and kept_pred.step_time == pred.step_time


def _prediction(step_time: float, engine_time: float, **counts: int):
    from gradckpt.planning.handlers.engine_counts import EngineCounts
    from gradckpt.planning.simulation.simulate import Prediction

    return Prediction(
        peak_bytes=0, step_time=step_time, overhead=0.0, recompute_time=0.0,
        recompute_flops=0, peak_position=0, engine_time=engine_time,
        engine_counts=EngineCounts(**counts),
    )  # fmt: skip


def test_a_slower_plan_is_alike_only_within_the_noise_of_what_differs(zoo):
    from dataclasses import replace

    from gradckpt.measure.engine_costs import EngineCosts

    _, prof, _ = zoo.get("gpt")
    costs = EngineCosts(region=1e-3, recompute_op=1e-5, device="cpu")
    prof = replace(prof, engine_costs=costs, step_time=1.0)  # 1 ms a region, 10 us an op
    base = _prediction(1.0, 0.0, regions=2)
    # 1 ms more of recomputed kernels alone: the kernels' noise is a quarter of it.
    assert not solvers.alike_in_time(prof, base, _prediction(1.001, 0.0, regions=2))
    # 1 ms more of kernels bought back by one region less (0.9 ms priced, 0.1 ms net): alike.
    fewer = _prediction(1.0001, -0.0009, regions=1)
    assert solvers.alike_in_time(prof, base, fewer)
    # Faster is alike too; 4 ms more of kernels against one region less is not.
    assert solvers.alike_in_time(prof, base, _prediction(0.999, 0.0, regions=2))
    assert not solvers.alike_in_time(prof, base, _prediction(1.003, -0.001, regions=1))
