"""Kept units cost nothing per call: where no segment can be open, their wrapper calls the plain forward.

On short ops (a GPU's regime) every microsecond a wrapper spends per unit call
shows in the step; a kept unit of a plan without segments runs its plain
forward on every path, so its wrapper goes there straight (issue #42). Where
the plan has segments, kept units still take the full path: a segment's
region checks that its units run in the planned order.
"""

from __future__ import annotations

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


def test_a_keep_everything_plan_runs_no_wrapper_logic_and_the_plain_gradients(monkeypatch):
    ex = make("gpt", layers=2)
    plain = _plain_grads(ex)
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget=1.0, measure_candidates=0)
    assert all(u.mode == "keep" for u in plan.units)
    _refuse_full_path(monkeypatch)
    assert _same_grads(ex, plain)
    gradckpt.remove(ex.model)


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
