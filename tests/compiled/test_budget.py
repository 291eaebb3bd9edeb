"""fit_compiled: a byte budget held at the allocator by the compiled step (issue 13, items 2-3).

Candidates (gradckpt plans run by the compiler, and the compiler's own
activation_memory_budget) are compiled and measured at the allocator; the
choice is the fastest that fits. Tested: never over the budget, peak
monotone in the budget, the installed step measured again fits, and its
gradients are the plain ones (aot_eager: same partitioner as inductor, no
fusion, so random draws and sums match eager within 1e-5).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from gradckpt.compiled.budget import choose, fit_compiled, measure_points
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.testing import make

pytest.importorskip("torch._dynamo")

GPT = dict(layers=3, d_model=32, heads=2, seq=64, vocab=128, batch=4, dropout=0.1)
OPTIONS = dict(
    backend="aot_eager", plan_fractions=(0.8, 0.5, 0.3), compiler_budgets=(1.0, 0.5, 0.0),
    saved_fractions=(0.6, 0.3), repeats=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def measured():
    torch._dynamo.reset()
    ex = make("gpt", **GPT)
    points = measure_points(ex.model, ex.loss_fn, **OPTIONS)
    yield ex, points
    torch._dynamo.reset()


def test_candidates_are_measured_and_model_left_plain(measured):
    ex, points = measured
    labels = [p.label for p in points]
    assert any(p.plan is not None for p in points), labels  # gradckpt plans were compiled
    assert {p.compiler_budget for p in points if p.compiler_budget is not None} == {1.0, 0.5, 0.0}
    assert {p.saved_fraction for p in points if p.saved_fraction is not None} == {0.6, 0.3}
    assert all(p.peak_bytes > 0 and p.step_time > 0 for p in points)
    assert ex.model._compiled_call_impl is None
    assert all("forward" not in m.__dict__ for m in ex.model.modules())


def test_choice_never_over_budget_and_peak_monotone_in_budget(measured):
    _, points = measured
    peaks = sorted({p.peak_bytes for p in points})
    budgets = sorted(
        {*peaks, *(b + 1 for b in peaks), *((a + b) // 2 for a, b in itertools.pairwise(peaks))}
    )
    chosen = [choose(points, b) for b in budgets]
    for budget, point in zip(budgets, chosen):
        assert point.peak_bytes <= budget
        fitting = [p for p in points if p.peak_bytes <= budget]
        assert point.step_time == min(p.step_time for p in fitting)
    chosen_peaks = [p.peak_bytes for p in chosen]
    assert chosen_peaks == sorted(chosen_peaks), list(zip(budgets, chosen_peaks))
    with pytest.raises(BudgetError, match="least measured peak"):
        choose(points, peaks[0] - 1)


def test_fit_compiled_installs_a_step_that_fits_with_plain_gradients(measured, loss_and_grads):
    ex, points = measured
    torch._dynamo.reset()
    plain = make("gpt", **GPT)
    ref = loss_and_grads(plain)[1]
    gradckpt_points = [p for p in points if p.plan is not None]
    budget = min(p.peak_bytes for p in gradckpt_points)  # only the leanest fits, or less
    fit = fit_compiled(ex.model, ex.loss_fn, budget, points=points, backend="aot_eager")
    assert fit.chosen.peak_bytes <= budget
    for _ in range(2):  # warm: compile forward and backward
        loss_and_grads(ex)
    ex.model.zero_grad(set_to_none=True)
    with AllocatorTracker() as again:
        ex.loss_fn().backward()
    peak = state_bytes(ex.model) + again.peak_bytes
    assert peak <= budget, (peak, budget, fit.chosen.label)
    got = loss_and_grads(ex)[1]
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=0, msg=k)


def test_a_saved_bytes_point_installs_with_plain_gradients(
    measured, monkeypatch, loss_and_grads, request
):
    """The compiler's partitioner under gradckpt's byte cap, installed by fit_compiled."""
    from gradckpt.compiled.knapsack import SavedBytesSolver

    ex, points = measured
    torch._dynamo.reset()
    # Partition here, not from a cache. torch's own patch, not monkeypatch: undoing a
    # monkeypatch on torch's config module deletes the option (hides it for the process).
    no_cache = torch._functorch.config.patch(enable_autograd_cache=False)
    no_cache.__enter__()
    request.addfinalizer(lambda: no_cache.__exit__(None, None, None))
    partitioned = []
    solve = SavedBytesSolver.__call__
    monkeypatch.setattr(
        SavedBytesSolver, "__call__",
        lambda self, *a: partitioned.append(self.fraction) or solve(self, *a),
    )  # fmt: skip
    ref = loss_and_grads(make("gpt", **GPT))[1]
    capped = [p for p in points if p.saved_fraction is not None]
    fit = fit_compiled(ex.model, ex.loss_fn, max(p.peak_bytes for p in points), points=capped,
                       backend="aot_eager")  # fmt: skip
    assert fit.chosen.saved_fraction in (0.6, 0.3)
    got = loss_and_grads(ex)[1]
    assert partitioned and set(partitioned) == {fit.chosen.saved_fraction}
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=0, msg=k)


def test_fused_profile_makes_ops_without_flops_free_and_keeps_the_rest():
    import gradckpt
    from gradckpt.compiled.budget import fused_profile
    from gradckpt.planning.simulation.simulate import simulate
    from gradckpt.planning.solving.solvers import none_plan

    ex = make("gpt", **GPT)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    fused = fused_profile(prof)
    assert any(op.flops == 0 and op.time > 0 for op in prof.ops)  # something to fuse
    for before, after in zip(prof.ops, fused.ops, strict=True):
        assert after.time == (0.0 if before.flops == 0 else before.time)
        assert after.outputs == before.outputs
    for unit in fused.units:
        ops = [op for op in fused.ops if op.unit == unit.index]
        assert unit.fwd_time == sum(op.time for op in ops if not op.backward)
        assert unit.bwd_time == sum(op.time for op in ops if op.backward)
    assert fused.storages == prof.storages and fused.packs == prof.packs
    plain = none_plan(prof)  # bytes are the eager ones: the same predicted peak
    assert simulate(fused, plain).peak_bytes == simulate(prof, plain).peak_bytes
