"""Pipeline stages on 2 and 4 CPU ranks (gloo): a plan per stage, each rank's whole steps in budget.

The ranks are this file run as a script (``python test_pipeline.py MODEL OUT``);
each builds the same decoder split in as many stages as there are ranks
(``gradckpt.testing.pipelines``; GPT and Llama on 2 ranks, 4 micro-batches; tiny
ones on 4 ranks, 8 micro-batches, so the suite stays cheap), keeps its own
stage and trains it under ``Schedule1F1B`` and ``ScheduleGPipe``
for 3 steps (AdamW): once plain, once with the stage planned by
``fit_stage`` for one byte budget. Every rank's allocator high-water over the 3
whole steps (forward, backward, send/recv, ``optimizer.step()``) is checked
against the budget, and its gradients and parameters against the plain run's,
bit for bit (no chunking; dropout on, replayed by the engine).
"""

from __future__ import annotations

import sys

import pytest
import torch

from gradckpt.integrations.pipeline import in_flight
from gradckpt.integrations.pipeline_report import StagePlan, compare, summary
from gradckpt.integrations.pipeline_schedules import schedule_name

WORLD = 2
M = 4  # micro-batches
CONFIG = dict(layers=4, d_model=64, heads=4, seq=64, vocab=256, dropout=0.1)
BATCH = 8
#: Per world size: the decoder's sizes and micro-batches (4 ranks: two blocks a stage).
SETUPS = {
    2: (CONFIG, M),
    4: (dict(layers=8, d_model=32, heads=2, seq=32, vocab=128, dropout=0.1), 8),
}
#: (model, ranks) launched: both models on 2 and on 4 ranks.
CASES = [("gpt", 2), ("llama", 2), ("gpt", 4), ("llama", 4)]
SCHEDULES = ("1f1b", "gpipe")
#: The budget: this share of the larger of the two ranks' plain whole-step peaks (measured
#: in the same processes), so it binds on at least one stage.
SHARE = 0.8
STEPS = 3
TIMEOUT_S = 240


# ------------------------------------------------------------------ the ranks


def _batch(config: dict = CONFIG):
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, config["vocab"], (BATCH, config["seq"] + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _train(module, rank: int, world: int, schedule_cls, steps: int = STEPS) -> dict:
    """``steps`` whole steps of one stage under the schedule; the allocator's high-water."""
    from torch.distributed.pipelining import PipelineStage

    from gradckpt.measure import AllocatorTracker
    from gradckpt.testing.pipelines import next_token_loss

    config, m = SETUPS[world]
    x, y = _batch(config)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = schedule_cls(stage, m, loss_fn=next_token_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    losses: list = []
    with AllocatorTracker() as at:
        for step in range(steps):
            torch.manual_seed(100 + 10 * step + rank)  # dropout: the same draws in both runs
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            if step == steps - 1:  # after the backward: never part of the peak
                grads = {k: p.grad.clone() for k, p in module.named_parameters()}
            opt.step()
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return {
        "peak": params + at.peak_bytes,
        "grads": grads,
        "params": {k: p.detach().clone() for k, p in module.named_parameters()},
        "losses": [loss.detach() for loss in losses],
    }


def _rank(model: str, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from gradckpt.integrations.pipeline import fit_stage
    from gradckpt.integrations.pipeline_report import gather_stage_plans
    from gradckpt.testing.pipelines import gpt_stages, next_token_loss

    out: dict = {}
    config, m = SETUPS[world]
    x, y = _batch(config)
    mb = BATCH // m
    for cls in (Schedule1F1B, ScheduleGPipe):
        name = schedule_name(cls)
        plain = _train(gpt_stages(world, kind=model, **config)[rank], rank, world, cls)
        peaks = [torch.tensor(plain["peak"])]
        dist.all_reduce(peaks[0], op=dist.ReduceOp.MAX)
        budget = int(SHARE * peaks[0].item())
        module = gpt_stages(world, kind=model, **config)[rank]
        inputs = (x[:mb],) if rank == 0 else (torch.randn(mb, config["seq"], config["d_model"]),)
        stage_plan = fit_stage(
            module, inputs, budget, schedule=cls, stage_index=rank, num_stages=world,
            n_microbatches=m, loss=next_token_loss, target=y[:mb], optimizer="adamw",
            repeats=2,
        )  # fmt: skip
        planned = _train(module, rank, world, cls)
        out[name] = {
            "budget": budget,
            "plain": plain,
            "planned": planned,
            "plans": [p.to_json() for p in gather_stage_plans(stage_plan)],
        }
    return out


def _main(model: str, out_dir: str) -> None:
    from _ranks import run_rank

    run_rank(lambda rank, world: _rank(model, rank, world), out_dir)


# ------------------------------------------------------------------ launching


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{w}ranks" for m, w in CASES])
def ranks(request, tmp_path_factory, launch_ranks):
    pytest.importorskip("torch.distributed.pipelining")
    model, world = request.param
    out_dir = tmp_path_factory.mktemp(f"pipeline-{model}-{world}")
    return launch_ranks(__file__, [model, str(out_dir)], out_dir, world, TIMEOUT_S)


# --------------------------------------------------------------------- tests


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_rank_holds_the_budget_over_three_whole_steps(ranks, schedule):
    budget = ranks[0][schedule]["budget"]
    assert max(r[schedule]["plain"]["peak"] for r in ranks) > budget  # the budget binds
    for rank, result in enumerate(ranks):
        plan = StagePlan.from_json(result[schedule]["plans"][rank])
        assert plan.predicted_peak_bytes <= budget
        assert result[schedule]["planned"]["peak"] <= budget, (
            rank, result[schedule]["planned"]["peak"], budget, plan.predicted_peak_bytes)  # fmt: skip


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_and_parameters_equal_the_plain_pipeline_bit_for_bit(ranks, schedule):
    for result in ranks:
        plain, planned = result[schedule]["plain"], result[schedule]["planned"]
        for k in plain["grads"]:
            assert torch.equal(planned["grads"][k], plain["grads"][k]), k
            assert torch.equal(planned["params"][k], plain["params"][k]), k
        assert [float(v) for v in planned["losses"]] == [float(v) for v in plain["losses"]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_stage_is_planned_for_its_in_flight_micro_batches(ranks, schedule):
    plans = [StagePlan.from_json(d) for d in ranks[0][schedule]["plans"]]
    world, m = len(ranks), SETUPS[len(ranks)][1]
    assert [p.in_flight for p in plans] == [in_flight(schedule, s, world, m) for s in range(world)]
    assert all(p.plan.budget_bytes == ranks[0][schedule]["budget"] for p in plans)
    table = summary(plans)
    for p in plans:
        assert p.describe() in table
    assert compare(plans).step_time > 0


# ------------------------------------------------------ one process, no ranks


def test_in_flight_follows_the_schedule():
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8] * 4


def test_schedules_other_than_gpipe_and_1f1b_are_refused_with_the_reason():
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    with pytest.raises(ValueError, match="virtual stages"):
        schedule_name(ScheduleInterleaved1F1B)
    with pytest.raises(ValueError, match="zero-bubble"):
        schedule_name("ScheduleInterleavedZeroBubble")
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule_name("bfs")
    with pytest.raises(ValueError, match="stage_index"):
        in_flight("1f1b", 4, 4, 8)


def test_fsdp_inside_a_stage_counts_one_rank_s_parameters_and_plans_no_segments():
    import gradckpt
    from gradckpt.integrations.distributed import rank_memory
    from gradckpt.integrations.pipeline import plan_stage, stage_loss_fn
    from gradckpt.planning import Segment
    from gradckpt.testing.pipelines import gpt_stages

    torch.set_num_threads(1)
    stage = gpt_stages(WORLD, **CONFIG)[0]
    x = _batch()[0][: BATCH // M]
    prof = gradckpt.profile(stage, stage_loss_fn(stage, (x,)), repeats=1)
    opts = dict(schedule="1f1b", stage_index=0, num_stages=WORLD, n_microbatches=M, profile=prof)
    alone = plan_stage(stage, (x,), 1 << 40, **opts)
    sharded = plan_stage(stage, (x,), 1 << 40, fsdp_world_size=2, **opts)
    shift = rank_memory(stage, 2).param_bytes - rank_memory(stage, 1).param_bytes
    assert sharded.plain_peak_bytes == alone.plain_peak_bytes + shift
    tight = plan_stage(stage, (x,), int(0.8 * sharded.plain_peak_bytes), fsdp_world_size=2, **opts)
    assert tight.predicted_peak_bytes <= tight.budget_bytes
    assert any(u.mode != "keep" for u in tight.plan.units)
    assert not any(isinstance(item, Segment) for item in tight.plan.items)


def test_a_stage_timed_together_prices_its_ops_at_the_rate_of_its_step():
    import gradckpt
    from gradckpt.integrations.pipeline import stage_loss_fn
    from gradckpt.integrations.pipeline_timing import in_process_group, retimed_to
    from gradckpt.planning.simulation.simulate import simulate
    from gradckpt.planning.solving.baselines import every_kth_plan
    from gradckpt.testing.pipelines import gpt_stages

    stage = gpt_stages(WORLD, **CONFIG)[0]
    x = _batch()[0][: BATCH // M]
    prof = gradckpt.profile(stage, stage_loss_fn(stage, (x,)), repeats=1)
    slow = retimed_to(prof, 1.5 * prof.step_time)
    assert slow.step_time == pytest.approx(1.5 * prof.step_time)
    assert [o.time for o in slow.ops] == pytest.approx([1.5 * o.time for o in prof.ops])
    plan = every_kth_plan(prof, 1)
    assert simulate(slow, plan).recompute_time == pytest.approx(
        1.5 * simulate(prof, plan).recompute_time
    )
    assert not in_process_group()  # one process: plan_stage profiles as before


def test_a_budget_no_plan_meets_names_the_stage_and_its_in_flight_count():
    from gradckpt.integrations.pipeline import plan_stage
    from gradckpt.planning.solving.budget import BudgetError
    from gradckpt.testing.pipelines import gpt_stages

    stage = gpt_stages(WORLD, **CONFIG)[0]
    x = _batch()[0][: BATCH // M]
    with pytest.raises(BudgetError, match=r"stage 0 of 2 \(gpipe, 4 micro-batches in flight\)"):
        plan_stage(stage, (x,), 1 << 20, schedule="gpipe", stage_index=0, num_stages=WORLD,
                   n_microbatches=M, repeats=1)  # fmt: skip
    with pytest.raises(ValueError, match="not a fraction"):
        plan_stage(stage, (x,), 0.5, schedule="gpipe", stage_index=0, num_stages=2,
                   n_microbatches=M)  # fmt: skip
    with pytest.raises(ValueError, match="pass loss="):
        plan_stage(stage, (x,), 1 << 30, schedule="gpipe", stage_index=1, num_stages=2,
                   n_microbatches=M)  # fmt: skip


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
