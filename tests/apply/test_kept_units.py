"""Kept units cost nothing per call: where no segment can be open, they run without a wrapper.

On short ops (a GPU's regime) every microsecond a wrapper spends per unit call
shows in the step; a kept unit of a plan without segments runs its plain
forward on every path, so ``fit`` installs nothing on it (issue #42), and
where a wrapper is needed (segments, a unit checking its own shape) a kept
unit's goes to the plain forward straight. Where the plan has segments, kept
units still take the full path: a segment's region checks that its units run
in the planned order.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gradckpt
from gradckpt.apply.wrappers import UnitForward
from gradckpt.engine import CheckpointError
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.profiling import model_fingerprint
from gradckpt.testing import make


def _refuse_full_path(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{self.unit.path} took the full wrapper path")

    monkeypatch.setattr(UnitForward, "run", refuse)


def _plain_grads(ex) -> dict[str, torch.Tensor]:
    """The plain step's gradients (seeded), the model's grads cleared after."""
    torch.manual_seed(0)
    ex.loss_fn().backward()
    grads = {n: p.grad.clone() for n, p in ex.model.named_parameters()}
    ex.model.zero_grad(set_to_none=True)
    return grads


def _same_grads(ex, plain: dict[str, torch.Tensor]) -> bool:
    torch.manual_seed(0)
    ex.loss_fn().backward()
    return all(torch.equal(p.grad, plain[n]) for n, p in ex.model.named_parameters())


def _own_forwards(model) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def test_a_keep_everything_fit_wraps_only_the_root_and_gives_the_plain_gradients(monkeypatch):
    ex = make("gpt", layers=2)
    plain = _plain_grads(ex)
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget=1.0, measure_candidates=0)
    assert all(u.mode == "keep" for u in plan.units)
    assert _own_forwards(ex.model) == [""]  # the shape guard's root wrapper alone
    _refuse_full_path(monkeypatch)
    assert _same_grads(ex, plain)
    gradckpt.remove(ex.model)
    assert _own_forwards(ex.model) == []


def test_kept_units_beside_a_recomputed_one_run_unwrapped_and_the_gradients_are_plain():
    ex = make("gpt", layers=2)
    plain = _plain_grads(ex)
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget=1.0, measure_candidates=0)
    items = tuple(
        UnitChoice(u.path, gradckpt.Recompute()) if u.path == "blocks.1" else u
        for u in plan.items
    )
    # Applied alone, the plan's units check their own shapes (the guard learns the call's).
    gradckpt.apply(ex.model, dataclasses.replace(plan, items=items))
    assert "blocks.0" in _own_forwards(ex.model)
    fitted = gradckpt.fit(ex.model, ex.loss_fn, budget=0.9, measure_candidates=0, chunking=False)
    kept = {u.path for u in fitted.units if u.mode == "keep"}
    assert kept and len(kept) < len(fitted.units)
    assert not kept & set(_own_forwards(ex.model))
    assert _same_grads(ex, plain)
    gradckpt.remove(ex.model)


def test_a_kept_unit_whose_forward_another_library_replaced_keeps_a_wrapper():
    ex = make("gpt", layers=2)
    block = ex.model.blocks[0]
    foreign = block.forward  # a bound method in the module's __dict__, as accelerate's hooks do
    block.forward = foreign
    gradckpt.fit(ex.model, ex.loss_fn, budget=1.0, measure_candidates=0)
    assert isinstance(block.__dict__["forward"], UnitForward)
    gradckpt.remove(ex.model)
    assert block.__dict__["forward"] is foreign


def test_kept_units_of_a_plan_with_segments_still_check_the_planned_order(monkeypatch):
    ex = make("unet")
    items = (
        UnitChoice("down.0"), UnitChoice("down.1"),
        Segment((UnitChoice("down.2"), UnitChoice("up.0"))),
        UnitChoice("bottleneck"), UnitChoice("up.1"), UnitChoice("up.2"), UnitChoice("out"),
    )  # fmt: skip
    gradckpt.apply(ex.model, Plan(items, model_fingerprint(ex.model)))
    with pytest.raises(CheckpointError, match="planned order"):
        ex.loss_fn()  # the kept bottleneck runs inside the open segment
    gradckpt.remove(ex.model)


def test_kept_units_outside_an_open_segment_skip_the_wrapper_logic(monkeypatch):
    ex = make("gpt", layers=4)
    plain = _plain_grads(ex)
    items = (
        *(UnitChoice(p) for p in ("tok_emb", "pos_emb", "blocks.0", "blocks.1")),
        Segment((UnitChoice("blocks.2"), UnitChoice("blocks.3"))),
        UnitChoice("ln_f"),
        UnitChoice("lm_head"),
    )
    gradckpt.apply(ex.model, Plan(items, model_fingerprint(ex.model)))
    full = []
    run = UnitForward.run

    def counted(self, *args, **kwargs):
        full.append(self.unit.path)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(UnitForward, "run", counted)
    assert _same_grads(ex, plain)
    # Only the segment's units (and their replay in its recompute) take the full path.
    assert set(full) == {"blocks.2", "blocks.3"}
    gradckpt.remove(ex.model)
