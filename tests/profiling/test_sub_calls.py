"""Profiles record the op spans of modules inside blocks (what MLP chunking reads, #41)."""

from __future__ import annotations

import torch
from torch import nn

import gradckpt
from gradckpt.profiling.records import Profile
from gradckpt.profiling.sub_calls import inner_candidates
from gradckpt.profiling.units import Unit


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(8), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def test_inner_candidates_are_block_children_with_children():
    blocks = [Block(), Block()]
    units = [Unit(f"b.{i}", b, True) for i, b in enumerate(blocks)]
    assert [p for p, _ in inner_candidates(units)] == ["b.0.mlp", "b.1.mlp"]  # not the norms
    assert list(inner_candidates([Unit("b.0", blocks[0], False)])) == []  # not a block


def test_a_profile_records_each_mlp_call_and_reads_it_back(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block())
    x = torch.randn(2, 16, 8)
    prof = gradckpt.profile(model, lambda: model(x).square().mean(), repeats=1)
    calls = {c.path: c for c in prof.sub_calls}
    assert sorted(calls) == ["0.mlp", "1.mlp", "2.mlp"]
    for c in calls.values():
        unit = prof.units[c.unit]
        assert c.path.startswith(unit.path + ".")
        assert unit.first_op <= c.first_op < c.end_op <= unit.end_op
        assert c.input_shape == c.output_shape == (2, 16, 8) and c.tensor_args == 1
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").sub_calls == prof.sub_calls
