"""Stages split by ``torch.distributed.pipelining.pipeline()`` at ``SplitPoint``s, planned and run.

The traced stages' submodules are all ``InterpreterModule``s; ``plan_stage`` takes
their blocks from the stage's graph (``traced_block_paths``). The ranks are this
file run as a script (``python test_pipeline_split.py OUT``, 2 gloo ranks, one
thread each): each traces the same decoder (``gradckpt.testing.pipelines.decoder``)
split before ``blocks.2``, builds its stage with ``pipe.build_stage`` and trains it
under ``Schedule1F1B`` for 3 steps (AdamW, 4 micro-batches): once plain, once with
the stage planned by ``fit_stage`` at 0.8 of the larger plain peak. Every rank's
allocator high-water is within the budget, and its parameters and the losses
equal the plain run's bit for bit.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

CONFIG = dict(layers=4, d_model=64, heads=4, seq=64, vocab=256)
BATCH, M = 8, 4
SHARE = 0.8  # the budget: this share of the larger plain whole-step peak
WORLD, STEPS, TIMEOUT_S = 2, 3, 180


def _batch():
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, CONFIG["vocab"], (BATCH, CONFIG["seq"] + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _traced():
    """The decoder traced and split before ``blocks.2`` (a ``Pipe`` of two stages)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from gradckpt.testing.pipelines import decoder

    x = _batch()[0][: BATCH // M]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export's own deprecation notices
        return pipeline(decoder(**CONFIG), mb_args=(x,),
                        split_spec={"blocks.2": SplitPoint.BEGINNING})  # fmt: skip


# ------------------------------------------------------------------ the ranks


def _train(pipe, rank: int) -> dict:
    from torch.distributed.pipelining import Schedule1F1B

    from gradckpt.measure import AllocatorTracker
    from gradckpt.testing.pipelines import next_token_loss

    x, y = _batch()
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = Schedule1F1B(stage, M, loss_fn=next_token_loss)
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-2)
    losses: list = []
    with AllocatorTracker() as at:
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            opt.step()
    params = sum(p.numel() * p.element_size() for p in stage.submod.parameters())
    return {
        "peak": params + at.peak_bytes,
        "params": {k: p.detach().clone() for k, p in stage.submod.named_parameters()},
        "losses": [loss.detach() for loss in losses],
    }


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from gradckpt.integrations.pipeline import fit_stage
    from gradckpt.integrations.pipeline_report import gather_stage_plans
    from gradckpt.testing.pipelines import next_token_loss

    plain = _train(_traced(), rank)
    peak = torch.tensor(plain["peak"])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    budget = int(SHARE * peak.item())
    pipe = _traced()
    x, y = _batch()
    mb = BATCH // M
    inputs = (x[:mb],) if rank == 0 else (torch.randn(mb, CONFIG["seq"], CONFIG["d_model"]),)
    stage_plan = fit_stage(
        pipe.get_stage_module(rank), inputs, budget, schedule="1f1b", stage_index=rank,
        num_stages=world, n_microbatches=M, loss=next_token_loss, target=y[:mb],
        optimizer="adamw", repeats=2,
    )  # fmt: skip
    return {
        "budget": budget,
        "plain": plain,
        "planned": _train(pipe, rank),
        "plans": [p.to_json() for p in gather_stage_plans(stage_plan)],
    }


def _main(out_dir: str) -> None:
    from _ranks import run_rank

    run_rank(_rank, out_dir)


# --------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, launch_ranks):
    pytest.importorskip("torch.distributed.pipelining")
    out_dir = tmp_path_factory.mktemp("pipeline-split")
    return launch_ranks(__file__, [str(out_dir)], out_dir, WORLD, TIMEOUT_S)


def test_a_traced_stage_s_blocks_come_from_its_graph():
    from gradckpt.integrations.pipeline_traced import traced_block_paths

    torch.set_num_threads(1)
    pipe = _traced()
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    assert [type(s).__name__ for s in stages] == ["GraphModule", "GraphModule"]
    assert [traced_block_paths(s) for s in stages] == [
        ["blocks.0", "blocks.1"],
        ["blocks.2", "blocks.3"],
    ]
    assert traced_block_paths(torch.nn.Linear(2, 2)) is None


def test_traced_stages_planned_on_ranks_hold_the_budget_and_train_as_the_plain_ones(ranks):
    from gradckpt.integrations.pipeline_report import StagePlan

    budget = ranks[0]["budget"]
    assert max(r["plain"]["peak"] for r in ranks) > budget  # the budget binds
    plans = [StagePlan.from_json(d) for d in ranks[0]["plans"]]
    assert [p.in_flight for p in plans] == [2, 1]
    recomputed = [u.path for u in plans[0].plan.units if u.mode != "keep"]
    assert recomputed and all(path.startswith("blocks.") for path in recomputed)
    for result, plan in zip(ranks, plans):
        assert plan.predicted_peak_bytes <= budget
        assert result["planned"]["peak"] <= budget, (result["planned"]["peak"], budget)
        for k, p in result["plain"]["params"].items():
            assert torch.equal(result["planned"]["params"][k], p), k
        assert [float(v) for v in result["planned"]["losses"]] == [
            float(v) for v in result["plain"]["losses"]
        ]


if __name__ == "__main__":
    _main(sys.argv[1])
