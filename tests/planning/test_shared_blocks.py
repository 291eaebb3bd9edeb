"""A block called twice per step (shared weights) is never checkpointed, and the plan says so."""

from __future__ import annotations

import torch
from torch import nn

import gradckpt
from gradckpt.planning import Plan
from gradckpt.planning.explaining.explain import explain
from gradckpt.testing import ResidualMLPBlock


class SharedEnds(nn.Module):
    """Four blocks between two calls of one shared block (as ALBERT-style weight tying does)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMLPBlock(16, 64, 0.0) for _ in range(4))
        self.shared = ResidualMLPBlock(16, 64, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(x)
        for block in self.blocks:
            x = block(x)
        return self.shared(x)


def _setup():
    torch.manual_seed(0)
    model = SharedEnds()
    x = torch.randn(32, 16)
    return model, lambda: model(x).pow(2).mean()


def test_block_called_twice_is_named_in_summary_explain_and_plan_file(tmp_path):
    model, loss_fn = _setup()
    prof = gradckpt.profile(model, loss_fn, repeats=1)
    plan = gradckpt.plan(model, loss_fn, budget=0.9, profile=prof)
    assert plan.not_planned == (("shared", 2),)
    assert "shared" not in {u.path for u in plan.units}
    line = next(x for x in plan.summary().splitlines() if "shared" in x)
    assert "2x" in line and "never checkpointed" in line
    hints = explain(prof, plan).hints()
    assert any("shared runs 2 times" in h and "never checkpoints" in h for h in hints)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
