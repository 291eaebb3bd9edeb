"""Stages split by ``torch.distributed.pipelining.pipeline()`` at ``SplitPoint``s, planned and run.

The traced stages' submodules are all ``InterpreterModule``s; ``plan_stage`` takes
their blocks from the stage's graph (``traced_block_paths``). One process: the
stages are planned with ``plan_stages`` at a budget that fits stage 0 only with
recompute, applied, and one micro-batch run through both stages and the loss
(as the schedule runs them, without the send/recv) gives the gradients of the
unplanned traced stages bit for bit.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pipelining = pytest.importorskip("torch.distributed.pipelining")

CONFIG = dict(layers=4, d_model=32, heads=2, seq=16, vocab=64)
MB = 2  # one micro-batch's rows
M = 4  # micro-batches


@pytest.fixture(scope="module")
def traced():
    """The decoder traced and split before ``blocks.2``: two stage modules and a micro-batch."""
    from gradckpt.testing.pipelines import decoder

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, CONFIG["vocab"], (MB, CONFIG["seq"]), generator=g)
    y = torch.randint(0, CONFIG["vocab"], (MB, CONFIG["seq"]), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export's own deprecation notices
        pipe = pipelining.pipeline(
            decoder(**CONFIG),
            mb_args=(x,),
            split_spec={"blocks.2": pipelining.SplitPoint.BEGINNING},
        )
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    return stages, x, y


def test_a_traced_stage_s_blocks_come_from_its_graph(traced):
    from gradckpt.integrations.pipeline_traced import traced_block_paths

    stages, _, _ = traced
    assert [type(s).__name__ for s in stages] == ["GraphModule", "GraphModule"]
    assert [traced_block_paths(s) for s in stages] == [
        ["blocks.0", "blocks.1"],
        ["blocks.2", "blocks.3"],
    ]
    assert traced_block_paths(torch.nn.Linear(2, 2)) is None


def test_traced_stages_are_planned_and_run_with_the_plain_gradients(traced):
    import gradckpt
    from gradckpt.integrations.pipeline import plan_stages, summary
    from gradckpt.testing.pipelines import next_token_loss

    stages, x, y = traced
    stages = [copy.deepcopy(s) for s in stages]  # the fixture's stay unplanned
    plain = [copy.deepcopy(s) for s in stages]
    h = stages[0](x).detach()
    opts = dict(n_microbatches=M, loss=next_token_loss, target=y, optimizer="adamw", repeats=2)
    pairs = [(stages[0], (x,)), (stages[1], (h,))]
    probe = plan_stages(pairs, "1f1b", 1 << 40, **opts)
    assert all(u.mode == "keep" for p in probe for u in p.plan.units)
    leanest = min(u.peak_bytes for u in probe[0].uniform)
    budget = max((probe[0].plain_peak_bytes + leanest) // 2, probe[1].plain_peak_bytes)
    plans = plan_stages(pairs, "1f1b", budget, **opts)
    assert [p.in_flight for p in plans] == [2, 1]
    assert all(p.predicted_peak_bytes <= budget for p in plans)
    recomputed = [u.path for u in plans[0].plan.units if u.mode != "keep"]
    assert recomputed and all(path.startswith("blocks.") for path in recomputed), summary(plans)
    for stage, p in zip(stages, plans):
        gradckpt.apply(stage, p.plan)

    def step(pair):
        loss = next_token_loss(pair[1](pair[0](x)), y)
        loss.backward()
        return loss

    assert torch.equal(step(stages), step(plain))
    for planned, reference in zip(stages, plain):
        for (name, p), q in zip(planned.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), name
