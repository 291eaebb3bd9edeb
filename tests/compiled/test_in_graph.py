"""gradckpt.compile: the plan executed inside one compiled graph (issue 13, item 1).

Gradients are compared with the plain, uncompiled model from the same seed,
dropout on. aot_eager (no fusion, random draws in eager order) matches within
1e-5; inductor with ``fallback_random`` (eager's RNG) within 1e-4 (fused
reductions reorder float sums). That the plan's decisions reach the compiled
graph is shown by the backward graph's matmul count (recompute adds the
forward's matmuls to backward; kept units add none).
"""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.compiled.in_graph import compiled_plan, uncompile
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.planning.solving.solvers import save_matmuls_plan
from gradckpt.profiling import find_units, model_fingerprint
from gradckpt.testing import make

pytest.importorskip("torch._dynamo")
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx.experimental.symbolic_shapes import optimization_hint

GPT = dict(layers=3, d_model=32, heads=2, seq=16, vocab=128, batch=2, dropout=0.1)
MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mixed(ex) -> Plan:
    """keep, recompute and selective units side by side (selective from a real profile)."""
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    selective = next(u for u in save_matmuls_plan(prof).units if u.path == "blocks.1")
    items = [
        selective if u.path == "blocks.1"
        else UnitChoice(u.path, "recompute" if u.path == "blocks.0" else "keep")
        for u in find_units(ex.model, ex.block_paths)
    ]  # fmt: skip
    return Plan(tuple(items), model_fingerprint(ex.model))


def _counting_backend():
    """aot_eager with the min-cut partitioner, recording each backward graph's matmuls."""
    backward_matmuls: list[int] = []

    def backward_compiler(gm, _inputs):
        count = sum(
            1 for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in MATMULS
        )
        backward_matmuls.append(count)
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm),
        bw_compiler=backward_compiler,
        partition_fn=min_cut_rematerialization_partition,
    )
    return backend, backward_matmuls


def test_mixed_plan_compiled_gives_plain_gradients_aot_eager(loss_and_grads, assert_steps_close):
    ex = make("gpt", **GPT)
    ref = loss_and_grads(ex)
    gradckpt.apply(ex.model, _mixed(ex))
    gradckpt.compile(ex.model, ex.loss_fn, backend="aot_eager")
    assert_steps_close(ref, loss_and_grads(ex), atol=1e-5)
    assert_steps_close(ref, loss_and_grads(ex), atol=1e-5)  # second step: compiled code reused
    assert compiled_plan(ex.model) is not None


def test_fit_compile_inductor_gives_plain_gradients(loss_and_grads, assert_steps_close):
    """fit(..., compile=...) end to end on inductor; RNG as eager's (fallback_random)."""
    import torch._inductor.config as inductor_config

    ex = make("gpt", **{**GPT, "layers": 2, "seq": 64, "batch": 4})  # activations matter
    ref = loss_and_grads(ex)
    with inductor_config.patch(fallback_random=True):
        plan = gradckpt.fit(ex.model, ex.loss_fn, budget=0.7, compile=True)
        # Something is recomputed: a unit, or a segment (whose units read "keep").
        assert any(isinstance(i, Segment) or i.mode != "keep" for i in plan.items)
        assert compiled_plan(ex.model) == plan
        assert plan.measured_compiled_peak_bytes <= plan.budget_bytes  # held, measured
        got = loss_and_grads(ex)
    assert_steps_close(ref, got, atol=1e-4)


def test_decisions_reach_the_compiled_backward_graph(loss_and_grads, blocks_plan):
    """recompute > selective > keep in backward matmuls: the partitioner honours the tags."""
    counts = {}
    for name in ("keep", "selective", "recompute"):
        torch._dynamo.reset()
        ex = make("gpt", **GPT)
        plan = blocks_plan(ex, name) if name != "selective" else None
        if plan is None:
            prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
            plan = save_matmuls_plan(prof)
            assert any(u.mode == "selective" for u in plan.units)
        gradckpt.apply(ex.model, plan)
        backend, backward_matmuls = _counting_backend()
        gradckpt.compile(ex.model, ex.loss_fn, backend=backend)
        loss_and_grads(ex)
        counts[name] = sum(backward_matmuls)
    # Each block has 4 linears + 2 attention bmms; recomputing a block adds its
    # forward matmuls to backward; save_matmuls keeps them all.
    assert counts["recompute"] > counts["keep"]
    assert counts["selective"] == counts["keep"]


def _segment_plan(ex, mode: str) -> Plan:
    """blocks 0 and 1 as one segment, or each recomputed on its own (mode "recompute")."""
    items = []
    for u in find_units(ex.model, ex.block_paths):
        if u.path == "blocks.0" and mode == "segment":
            items.append(Segment((UnitChoice("blocks.0"), UnitChoice("blocks.1"))))
        elif u.path in ("blocks.0", "blocks.1"):
            if mode == "recompute":
                items.append(UnitChoice(u.path, "recompute"))
        else:
            items.append(UnitChoice(u.path))
    return Plan(tuple(items), model_fingerprint(ex.model))


def _saving_backend():
    """min-cut partitioner; records the bytes the forward graph saves and backward's matmuls."""
    record = {"saved": 0, "backward_matmuls": 0}

    def forward_compiler(gm, _inputs):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        for node in output.args[0]:
            value = getattr(node, "meta", {}).get("val")
            if isinstance(value, torch.Tensor):  # sizes at their hints if symbolic
                record["saved"] += optimization_hint(value.numel()) * value.element_size()
        return make_boxed_func(gm)

    def backward_compiler(gm, _inputs):
        record["backward_matmuls"] += sum(
            1 for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in MATMULS
        )
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=backward_compiler,
        partition_fn=min_cut_rematerialization_partition,
    )
    return backend, record


def test_segment_compiled_saves_less_than_its_units_recomputed_apart_same_gradients(
    loss_and_grads, assert_steps_close
):
    """A segment's inner boundary is recomputed, not saved; same recompute, plain gradients."""
    records = {}
    for mode in ("recompute", "segment"):
        torch._dynamo.reset()
        ex = make("gpt", **GPT)
        ref = loss_and_grads(ex)
        gradckpt.apply(ex.model, _segment_plan(ex, mode))
        backend, records[mode] = _saving_backend()
        gradckpt.compile(ex.model, backend=backend)
        assert_steps_close(ref, loss_and_grads(ex), atol=1e-5)
        assert compiled_plan(ex.model) is not None
    boundary = GPT["batch"] * GPT["seq"] * GPT["d_model"] * 4  # blocks.0's output, float32
    assert records["recompute"]["saved"] - records["segment"]["saved"] >= boundary
    assert records["segment"]["backward_matmuls"] == records["recompute"]["backward_matmuls"]


def test_selective_plan_needs_loss_fn():
    ex = make("gpt", **GPT)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    gradckpt.apply(ex.model, save_matmuls_plan(prof))
    with pytest.raises(ValueError, match="pass the plan's loss_fn"):
        gradckpt.compile(ex.model, backend="aot_eager")
    assert compiled_plan(ex.model) is None


def test_uncompile_restores_the_eager_plan(loss_and_grads, assert_steps_close, blocks_plan):
    ex = make("gpt", **GPT)
    ref = loss_and_grads(ex)
    gradckpt.apply(ex.model, blocks_plan(ex, "recompute"))
    before = {n: m.__dict__.get("forward") for n, m in ex.model.named_modules()}
    gradckpt.compile(ex.model, backend="aot_eager")
    uncompile(ex.model)
    assert before == {n: m.__dict__.get("forward") for n, m in ex.model.named_modules()}
    assert ex.model._compiled_call_impl is None
    assert_steps_close(ref, loss_and_grads(ex), atol=0)  # eager gradckpt again: bit-exact


def test_fit_compile_keeps_segments_at_a_budget_only_they_reach(loss_and_grads, assert_steps_close):
    """fit(compile=...) plans with segments; the compiled step runs them, plain gradients."""
    ex = make("gpt")  # default sizes: its leanest plan needs a segment
    ref = loss_and_grads(ex)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    # fit(compile=...) plans without chunking (its slices run on the eager engine).
    planner = gradckpt.Planner(prof, chunking=False)
    least, prediction = planner.least_peak()
    assert any(isinstance(i, Segment) for i in least.items), "the leanest plan uses a segment"
    unsegmented = gradckpt.Planner(prof, segments=False, chunking=False)
    # Halfway to what plans without segments reach: the compiled step may peak a
    # little above the eager prediction, and fit holds the budget measured.
    budget = (prediction.peak_bytes + unsegmented.least_peak()[1].peak_bytes) // 2
    with pytest.raises(gradckpt.BudgetError):  # below what plans without segments reach
        unsegmented.plan(budget)
    plan = gradckpt.fit(
        ex.model, ex.loss_fn, budget=budget, profiling=gradckpt.ProfileOptions(profile=prof),
        measure_candidates=0, compile={"backend": "aot_eager"},
    )  # fmt: skip
    assert any(isinstance(i, Segment) for i in plan.items) and compiled_plan(ex.model) == plan
    assert plan.measured_compiled_peak_bytes <= budget
    assert_steps_close(ref, loss_and_grads(ex), atol=1e-5)
