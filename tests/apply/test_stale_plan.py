"""A saved plan reused on a forward that changed between the units of a segment."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.engine import CheckpointError, active_frame
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.profiling import model_fingerprint
from gradckpt.testing import ResidualMLPBlock


class EditedBetweenBlocks(nn.Module):
    """Four blocks; with ``edit`` on, the forward scales block 1's output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMLPBlock(16, 32, 0.0) for _ in range(4))
        self.edit = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.edit and i == 1:
                x.mul_(2.0)
        return x


def _segment_plan(model) -> Plan:
    items = (Segment(tuple(UnitChoice(f"blocks.{i}") for i in range(3))), UnitChoice("blocks.3"))
    return Plan(items, model_fingerprint(model))


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_saved_plan_on_forward_with_new_in_place_edit_inside_a_segment_is_refused():
    torch.manual_seed(0)
    model = EditedBetweenBlocks()
    plan = _segment_plan(model)  # made for the forward without the edit
    model.edit = True  # the code changed; the structure (fingerprint) did not
    x = torch.randn(4, 16)
    gradckpt.apply(model, plan)
    with pytest.raises(CheckpointError, match="in place"):
        _grads(model, x)
    assert active_frame() is None
    gradckpt.remove(model)


def test_profile_of_the_edited_forward_breaks_the_chain_where_the_edit_is():
    # Planning again helps: no segment can span the edit (simulate refuses one there).
    torch.manual_seed(0)
    model = EditedBetweenBlocks()
    model.edit = True
    x = torch.randn(4, 16)
    prof = gradckpt.profile(model, lambda: model(x).pow(2).mean(), repeats=1)
    chained = {u.path: u.chained for u in prof.units}
    assert chained["blocks.1"] and not chained["blocks.2"] and chained["blocks.3"]
