"""The ``Chunk`` kind: where it is offered, what it is predicted to cost, and a real run.

The zoo GPT's vocabulary makes the loss's backward the least peak of every
keep/recompute/offload plan (tests/planning/test_offload_floor.py); chunking the
head and the loss goes below it. Predictions are held to the allocator's
measured peak (2%), gradients to fp32's 1e-5 relative per tensor.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

import gradckpt
from gradckpt.engine.decisions import Chunk, Keep, Recompute
from gradckpt.measure.flops import count_matmul_flops
from gradckpt.planning import Plan, UnitChoice
from gradckpt.planning.kinds.chunk.handler import allow_chunking
from gradckpt.planning.kinds.chunk.span import head_span
from gradckpt.planning.planner import Planner
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.solvers import least_peak_plan
from gradckpt.testing import make

from .conftest import assert_step_matches, run_step


def _chunked(plan: Plan) -> list[UnitChoice]:
    return [u for u in plan.units if isinstance(u.decision, Chunk)]


def test_the_head_and_its_cross_entropy_are_the_chunkable_span(zoo):
    _, prof, _ = zoo.get("gpt")
    span = head_span(prof)
    assert span.why_not == ""
    assert prof.units[span.unit].path == "lm_head"
    assert span.rows == 4 * 64  # batch x sequence
    assert span.end_op == prof.forward_ops  # up to the scalar loss
    # The logits and their log-softmax (forward), their gradients (backward) are per token.
    vocab = 4096 * 4
    assert sum(prof.storages[s].nbytes >= span.rows * vocab for s in span.per_token) >= 3


def test_only_the_head_is_offered_chunks_and_never_when_chunking_is_off(zoo):
    _, prof, _ = zoo.get("gpt")
    chain = Planner(prof).chain
    offered = {
        u.path: [o.chunks for o in opts if isinstance(o, Chunk)]
        for u, opts in zip(chain.units, chain.options)
    }
    assert offered.pop("lm_head") == [2, 4, 8, 16]  # at least 16 tokens a slice
    assert not any(offered.values())
    off = Planner(prof, chunking=False).chain
    assert not any(isinstance(o, Chunk) for opts in off.options for o in opts)


def test_plans_that_do_not_chunk_are_the_plans_made_without_chunking(zoo):
    _, prof, _ = zoo.get("gpt")
    on, off = Planner(prof), Planner(prof, chunking=False)
    for share in (0.6, 0.8, 1.0):
        planned = on.plan(share)
        if not _chunked(planned):
            assert planned == off.plan(share)
    assert not _chunked(on.plan(1.0))  # the plain step chunks nothing


def test_chunking_goes_below_the_loss_floor_and_the_run_holds_the_prediction(zoo):
    ex, prof, plain = zoo.get("gpt")
    with allow_chunking(False):
        _, floor = least_peak_plan(prof)
    budget = int(0.85 * floor.peak_bytes)
    plan = gradckpt.plan(ex.model, ex.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof))
    assert _chunked(plan) and plan.predicted_peak_bytes <= budget
    gradckpt.apply(ex.model, plan)
    try:
        step = run_step(ex)
    finally:
        gradckpt.remove(ex.model)
    assert step.peak <= budget
    assert abs(plan.predicted_peak_bytes - step.peak) <= 0.02 * step.peak
    assert_step_matches(plan, step, plain)
    with pytest.raises(gradckpt.BudgetError):
        gradckpt.plan(ex.model, ex.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof), chunking=False)


@pytest.mark.parametrize("chunks", [2, 16])
def test_a_chunk_plan_predicts_its_allocator_peak(zoo, chunks):
    ex, prof, plain = zoo.get("gpt")
    items = tuple(
        UnitChoice(u.path, Chunk(chunks) if u.path == "lm_head" else
                   Recompute() if u.is_block else Keep())
        for u in prof.units
    )  # fmt: skip
    plan = Plan(items, prof.fingerprint)
    pred = simulate(prof, plan)
    gradckpt.apply(ex.model, plan)
    try:
        step = run_step(ex)
    finally:
        gradckpt.remove(ex.model)
    assert abs(pred.peak_bytes - step.peak) <= 0.02 * step.peak, (pred.peak_bytes, step.peak)
    assert_step_matches(plan, step, plain)


def test_plan_files_say_chunk_and_are_version_two_only_when_they_chunk(zoo, tmp_path):
    _, prof, _ = zoo.get("gpt")
    with allow_chunking(False):
        _, floor = least_peak_plan(prof)
    chunked = Planner(prof).plan(int(0.85 * floor.peak_bytes))
    plain = Planner(prof).plan(1.0)
    assert chunked.to_json()["version"] == 2 and plain.to_json()["version"] == 1
    chunked.save(tmp_path / "c.json")
    assert Plan.load(tmp_path / "c.json") == chunked
    item = next(i for i in chunked.to_json()["items"] if i.get("mode") == "chunk")
    assert item["path"] == "lm_head" and item["chunks"] >= 2
    summary = chunked.summary()
    assert "lm_head" in summary and "slices of tokens" in summary and "order of sums" in summary
    explained = gradckpt.explain(prof, plan=chunked)
    head = next(u for u in explained.units if u.path == "lm_head")
    assert head.decision.startswith("chunk (") and "logits never whole" in head.decision
    assert "slices of chunked region lm_head and its loss" in explained.table()
    # Read by a gradckpt that knows version 1 only: refused by version, with what to do.
    data = chunked.to_json()
    data["version"] = 3
    with pytest.raises(gradckpt.PlanFormatError, match=r"version 3 is not supported.*plan"):
        Plan.from_json(data)


def _accuracy_loss(ex):
    def loss_fn():
        logits = ex.model(ex.inputs["idx"])
        targets = ex.inputs["targets"]
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        accuracy = (logits.argmax(-1) == targets).float().mean()  # reads the logits after the loss
        return loss + 0.0 * accuracy

    return loss_fn


def test_a_step_that_reads_the_logits_after_the_loss_is_never_chunked():
    ex = make("gpt", layers=2, d_model=32, seq=32, vocab=2048, batch=2)
    loss_fn = _accuracy_loss(ex)
    prof = gradckpt.profile(ex.model, loss_fn, repeats=1)
    assert "reads the logits of lm_head besides the cross-entropy" in head_span(prof).why_not
    assert not any(isinstance(o, Chunk) for opts in Planner(prof).chain.options for o in opts)


def test_a_chunk_plan_run_on_a_step_that_reads_the_logits_is_right_and_says_so():
    """A plan made for the plain loss, run on one that also reads the logits (never
    planned so): the values are the plain step's; a warning says the peak is not."""
    ex = make("gpt", layers=2, d_model=32, seq=32, vocab=2048, batch=2)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    items = tuple(UnitChoice(u.path, Chunk(4) if u.path == "lm_head" else Keep())
                  for u in prof.units)  # fmt: skip
    loss_fn = _accuracy_loss(ex)
    torch.manual_seed(0)
    ref = loss_fn()
    ref_grads = torch.autograd.grad(ref, list(ex.model.parameters()))
    gradckpt.apply(ex.model, Plan(items, prof.fingerprint))
    try:
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = loss_fn()
            grads = torch.autograd.grad(got, list(ex.model.parameters()))
    finally:
        gradckpt.remove(ex.model)
    assert any("read by argmax" in str(w.message) for w in caught)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
    for g, r in zip(grads, ref_grads):
        assert (g - r).norm() <= 1e-5 * r.norm()


def test_a_linear_heads_chunks_recompute_nothing_and_its_step_runs_the_plain_matmuls(zoo):
    """An ``nn.Linear`` head's chunked loss makes its gradients in the forward: the
    plan is priced with no recompute, and the step's matmul FLOPs are the plain step's."""
    ex, prof, _ = zoo.get("gpt")
    assert head_span(prof).linear
    items = tuple(
        UnitChoice(u.path, Chunk(4) if u.path == "lm_head" else Keep()) for u in prof.units
    )  # fmt: skip
    pred = simulate(prof, Plan(items, prof.fingerprint))
    assert pred.recompute_flops == 0 and pred.recompute_time == 0.0
    step = lambda: ex.loss_fn().backward()  # noqa: E731
    torch.manual_seed(7)
    plain_flops = count_matmul_flops(step)
    gradckpt.apply(ex.model, Plan(items, prof.fingerprint))
    try:
        torch.manual_seed(7)
        chunked_flops = count_matmul_flops(step)
    finally:
        gradckpt.remove(ex.model)
    ex.model.zero_grad(set_to_none=True)
    # The lazy logits' probe of the head's output shape: one row's matmul.
    hidden, vocab = ex.model.lm_head.in_features, ex.model.lm_head.out_features
    assert chunked_flops == plain_flops + 2 * hidden * vocab


@pytest.mark.parametrize("chunks", [2, 8])
def test_each_slice_beyond_the_first_pays_the_host_cost_of_the_heads_ops_again(zoo, chunks):
    """A slice runs the head's and the loss's ops, forward and backward, on fewer rows:
    the kernels' work is split, the host's per-op cost (dispatch, autograd, Python) is
    paid once per slice. Priced at the measured host cost per op of tiny ops."""
    from gradckpt.planning.simulation.costs import engine_seconds, step_costs

    _, prof, _ = zoo.get("gpt")
    span = head_span(prof)
    items = tuple(
        UnitChoice(u.path, Chunk(chunks) if u.path == "lm_head" else Keep()) for u in prof.units
    )  # fmt: skip
    counts = simulate(prof, Plan(items, prof.fingerprint)).engine_counts
    per_slice = (span.end_op - span.first_op) + len(span.backward)
    assert per_slice > 0 and counts.sliced_ops == (chunks - 1) * per_slice
    costs = step_costs(prof)
    assert costs.host_op > 0
    without = engine_seconds(dataclasses.replace(counts, sliced_ops=0), costs)
    assert engine_seconds(counts, costs) - without == pytest.approx(
        counts.sliced_ops * costs.host_op
    )
