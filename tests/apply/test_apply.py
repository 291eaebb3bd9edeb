"""apply/remove: in place, idempotent, refuses plans for other models, never half-applied."""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.profiling import model_fingerprint
from gradckpt.testing import make


def test_apply_is_in_place_idempotent_and_removable(loss_and_grads, blocks_plan):
    ex = make("gpt")
    loss0, plain = loss_and_grads(ex)
    plan = blocks_plan(ex)
    assert gradckpt.apply(ex.model, plan) is ex.model
    wrapped = ex.model.blocks[0].forward
    gradckpt.apply(ex.model, plan)  # idempotent: nothing re-wrapped
    assert ex.model.blocks[0].forward is wrapped
    assert gradckpt.applied_plan(ex.model) is plan
    loss1, grads = loss_and_grads(ex)
    assert torch.equal(loss0, loss1) and all(torch.equal(plain[k], grads[k]) for k in plain)
    gradckpt.remove(ex.model)
    assert gradckpt.applied_plan(ex.model) is None
    assert all("forward" not in m.__dict__ for m in ex.model.modules())
    assert torch.equal(loss_and_grads(ex)[0], loss0)


def test_applying_another_plan_replaces_the_first(blocks_plan):
    ex = make("gpt")
    gradckpt.apply(ex.model, blocks_plan(ex))
    keep_all = Plan(
        tuple(UnitChoice(u.path) for u in blocks_plan(ex).units), model_fingerprint(ex.model)
    )
    gradckpt.apply(ex.model, keep_all)
    assert gradckpt.applied_plan(ex.model) is keep_all
    gradckpt.remove(ex.model)


def test_plan_for_another_model_is_refused_and_model_untouched(blocks_plan):
    ex = make("gpt")
    other = make("gpt", layers=3)
    plan = blocks_plan(other)
    with pytest.raises(gradckpt.PlanMismatchError, match="another model"):
        gradckpt.apply(ex.model, plan)
    assert all("forward" not in m.__dict__ for m in ex.model.modules())


def test_plan_naming_a_missing_module_is_refused_before_touching_anything():
    ex = make("gpt")
    plan = Plan((UnitChoice("blocks.0", "recompute"), UnitChoice("nowhere", "recompute")),
                model_fingerprint(ex.model))  # fmt: skip
    with pytest.raises(gradckpt.PlanMismatchError, match="nowhere"):
        gradckpt.apply(ex.model, plan)
    assert "forward" not in ex.model.blocks[0].__dict__


def test_segment_regions_open_and_close_even_when_a_unit_raises(loss_and_grads):
    ex = make("mlp")
    plan = Plan(
        (
            UnitChoice("inp"),
            Segment(tuple(UnitChoice(p) for p in ex.block_paths)),
            UnitChoice("head"),
        ),
        model_fingerprint(ex.model),
    )
    gradckpt.apply(ex.model, plan)
    block = ex.model.blocks[2]
    original = block.forward

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    ex.model.blocks[2].forward = broken
    with pytest.raises(RuntimeError, match="boom"):
        ex.loss_fn()
    ex.model.blocks[2].forward = original
    from gradckpt.engine import active_frame

    assert active_frame() is None
    # The model still trains correctly afterwards.
    gradckpt.remove(ex.model)
    loss0, plain = loss_and_grads(ex)
    gradckpt.apply(ex.model, plan)
    loss1, grads = loss_and_grads(ex)
    gradckpt.remove(ex.model)
    assert torch.equal(loss0, loss1) and all(torch.equal(plain[k], grads[k]) for k in plain)


def test_shape_other_than_planned_warns_once(blocks_plan):
    ex = make("gpt")
    plan = blocks_plan(ex)
    plan = Plan(plan.items, plan.fingerprint, input_shapes=(("blocks.0", (9, 9, 9)),))
    gradckpt.apply(ex.model, plan)
    with pytest.warns(UserWarning, match="planned for inputs of shape"):
        ex.loss_fn()
    gradckpt.remove(ex.model)


def test_selective_op_mismatch_warns_and_stays_correct(loss_and_grads, blocks_plan):
    ex = make("gpt")
    loss0, plain = loss_and_grads(ex)
    items = tuple(
        UnitChoice(u.path, "selective", (0,), ("aten.not_this_op.default",))
        if u.path == "blocks.0" else u
        for u in blocks_plan(ex).units
    )  # fmt: skip
    gradckpt.apply(ex.model, Plan(items, model_fingerprint(ex.model)))
    with pytest.warns(UserWarning, match="plan expected"):
        loss1, grads = loss_and_grads(ex)
    gradckpt.remove(ex.model)
    assert torch.equal(loss0, loss1) and all(torch.equal(plain[k], grads[k]) for k in plain)


def test_segment_whose_units_are_not_called_in_order_is_refused_at_run_time():
    ex = make("unet")
    paths = ["down.0", "down.1", "down.2", "bottleneck", "up.0", "up.1", "up.2", "out"]
    items = (
        UnitChoice("down.0"), UnitChoice("down.1"),
        Segment((UnitChoice("down.2"), UnitChoice("up.0"))),
        UnitChoice("bottleneck"), UnitChoice("up.1"), UnitChoice("up.2"), UnitChoice("out"),
    )  # fmt: skip
    assert {u.path for u in Plan(items, "x").units} == set(paths)
    gradckpt.apply(ex.model, Plan(items, model_fingerprint(ex.model)))
    from gradckpt.engine import CheckpointError, active_frame

    with pytest.raises(CheckpointError, match="planned order"):
        ex.loss_fn()
    assert active_frame() is None
    gradckpt.remove(ex.model)
