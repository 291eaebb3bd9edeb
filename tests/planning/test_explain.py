"""``gradckpt.explain``: what the step keeps for backward, checked against autograd itself.

* The plain step's kept bytes equal the bytes of the distinct storages that
  autograd saves (``saved_tensors_hooks``, deduped by storage, step-created only).
* Under a plan the kept total shrinks by exactly what the planned model no longer
  holds at the end of its forward (live-storage tracker).
* A storage saved by several ops, or saved as a view, is one row.
* Per-unit recompute times add up to the simulator's; the peak is the simulator's.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt import explain
from gradckpt.measure import MemoryTracker
from gradckpt.planning.explaining.explain import STATUSES, Explanation
from gradckpt.planning.solving.solvers import every_kth_plan, finish, save_matmuls_plan, sqrt_plan
from gradckpt.testing import make

SIZES = {
    "gpt": dict(layers=3, d_model=32, heads=2, seq=16, vocab=64, batch=2),
    "mlp": dict(blocks=3, width=32, hidden=64, batch=16),
    "unet": dict(depth=2, base=4, image=16),
    "bn_convnet": dict(blocks=3, channels=8, image=8),
}


def saved_step_bytes(ex) -> int:
    """Independent: bytes of distinct storages autograd saves that the step created."""
    before = {
        t.untyped_storage()._cdata
        for t in [*ex.model.parameters(), *ex.model.buffers(), *ex.inputs.values()]
    }
    saved: dict[int, tuple[int, torch.Tensor]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in before:
            saved[storage._cdata] = (storage.nbytes(), t)  # held: no address reuse
        return t

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ex.loss_fn()
    del loss
    return sum(n for n, _ in saved.values())


def live_after_forward(ex) -> int:
    torch.manual_seed(0)
    with MemoryTracker(ex.model) as tracker:
        loss = ex.loss_fn()
        live = tracker.live_created_bytes
    del loss
    return live


@pytest.fixture(scope="module")
def profiled():
    out = {}
    for name, sizes in SIZES.items():
        ex = make(name, **sizes)
        out[name] = (ex, gradckpt.profile(ex.model, ex.loss_fn, repeats=1))
    return out


@pytest.mark.parametrize("name", list(SIZES))
def test_plain_kept_bytes_are_the_saved_storages(name, profiled):
    ex, prof = profiled[name]
    e = explain(prof)
    assert e.kept_bytes == saved_step_bytes(ex)
    assert e.recomputed_bytes == 0
    assert all(r.status == "kept" for r in e.rows)
    assert len({r.storage for r in e.rows}) == len(e.rows)
    assert e.kept_bytes == sum(r.nbytes for r in e.rows)


@pytest.mark.parametrize("name", ["gpt", "mlp", "unet"])
@pytest.mark.parametrize("scheme", ["every_block", "sqrt", "save_matmuls", "dp"])
def test_kept_bytes_shrink_by_what_the_plan_frees(name, scheme, profiled):
    ex, prof = profiled[name]
    if scheme == "dp":
        points = gradckpt.frontier(ex.model, ex.loss_fn, profile=prof)
        budget = (points[0].peak_bytes + prof.measured_peak_bytes) // 2  # halfway from least
        plan = gradckpt.plan(ex.model, ex.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof))
    else:
        make_plan = {"every_block": lambda p: every_kth_plan(p, 1), "sqrt": sqrt_plan,
                     "save_matmuls": save_matmuls_plan}[scheme]  # fmt: skip
        plan = finish(prof, make_plan(prof), None, scheme)[0]
    plain, planned = explain(prof), explain(prof, plan=plan)
    before = live_after_forward(ex)
    gradckpt.apply(ex.model, plan)
    try:
        after = live_after_forward(ex)
    finally:
        gradckpt.remove(ex.model)
    assert plain.kept_bytes - planned.kept_bytes == before - after
    assert planned.kept_bytes + planned.recomputed_bytes >= plain.kept_bytes
    assert {r.status for r in planned.rows} <= set(STATUSES)


class SavesTwice(nn.Module):
    """h is saved by mul (twice, as both operands) and, as a view, by sin."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # (4, 8)
        return (h * h).sum() + h.view(-1).sin().sum()


def test_a_storage_saved_several_times_or_as_a_view_counts_once():
    model = SavesTwice()
    x = torch.randn(4, 8)
    e = explain(model, lambda: model(x))
    (row,) = [r for r in e.rows if r.op == "aten.addmm.default"]
    assert row.nbytes == 4 * 8 * 4
    assert row.saved_by >= 3
    assert len({r.storage for r in e.rows}) == len(e.rows)


def test_units_costs_and_peak_agree_with_the_simulator(profiled):
    _, prof = profiled["gpt"]
    plan = finish(prof, sqrt_plan(prof), None, "sqrt")[0]
    e = explain(prof, plan=plan)
    pred = gradckpt.simulate(prof, plan)
    assert sum(u.recompute_time for u in e.units) == pytest.approx(pred.recompute_time)
    assert sum(u.kept_bytes for u in e.units) == e.kept_bytes
    assert sum(u.recomputed_bytes for u in e.units) == e.recomputed_bytes
    assert e.peak.peak_bytes == pred.peak_bytes
    assert e.peak.param_bytes + e.peak.kept_bytes + e.peak.other_bytes == e.peak.peak_bytes
    assert e.peak.phase in ("forward", "backward")
    decisions = {u.path: u.decision for u in e.units}
    assert decisions["blocks.0"].startswith("in segment blocks.0..")


def test_explain_a_model_uses_its_applied_plan_and_budget(profiled):
    ex, prof = profiled["gpt"]
    plan = finish(prof, every_kth_plan(prof, 1), None, "every_block")[0]
    gradckpt.apply(ex.model, plan)
    try:
        e = explain(ex.model, ex.loss_fn)
    finally:
        gradckpt.remove(ex.model)
    assert e.plan == plan and e.recomputed_bytes > 0
    by_budget = explain(ex.model, ex.loss_fn, budget=0.9)
    assert by_budget.plan is not None and by_budget.plan.budget_bytes is not None
    with pytest.raises(TypeError, match="loss_fn"):
        explain(ex.model)


def test_json_and_table(profiled):
    _, prof = profiled["gpt"]
    plan = finish(prof, every_kth_plan(prof, 1), None, "every_block")[0]
    e = explain(prof, plan=plan)
    data = json.loads(json.dumps(e.to_json()))
    assert data["kind"] == "gradckpt.Explanation"
    assert data["totals"]["kept_bytes"] == e.kept_bytes
    assert gradckpt.Plan.from_json(data["plan"]) == plan
    text = e.table()
    assert "blocks.1 (block): keeps" in text and "region input" in text and "recomputed" in text
    assert "bytes kept for backward" in text and str(e) == text
    assert isinstance(e, Explanation)


def test_gradient_dominated_peak_is_called_out():
    # Wide layers, a batch of one: the peak is parameters and gradients, not activations.
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    x = torch.randn(1, 512)
    e = explain(model, lambda: model(x).sum())
    assert e.peak.kept_bytes < 0.25 * (e.peak.peak_bytes - e.peak.param_bytes)
    assert any("checkpointing does not remove" in h for h in e.hints())


def test_explain_shows_kernel_workspace_where_it_sets_the_peak():
    ex = make("unet", depth=2, base=16, image=64, batch=2)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    e = explain(prof)
    assert e.peak.op == "aten.convolution_backward.default"
    conv_ws = {o.workspace for o in prof.ops if o.name == e.peak.op}
    assert e.peak.workspace_bytes in conv_ws and e.peak.workspace_bytes > 0
    parts = e.peak.param_bytes + e.peak.kept_bytes + e.peak.other_bytes + e.peak.workspace_bytes
    assert parts == e.peak.peak_bytes == prof.measured_peak_bytes
    assert "kernel workspace of convolution_backward" in e.table()
    assert e.to_json()["peak"]["workspace_bytes"] == e.peak.workspace_bytes


def test_explain_shows_no_workspace_when_the_peak_has_none(profiled):
    _, prof = profiled["mlp"]
    e = explain(prof)
    assert e.peak.workspace_bytes == 0 and "kernel workspace" not in e.table()
