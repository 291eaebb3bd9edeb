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
