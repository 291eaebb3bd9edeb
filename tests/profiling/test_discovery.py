"""Block discovery in any container: plain stage modules (timm's RegNet), ModuleDicts,
stages in stages; and what it says when it finds none."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import gradckpt
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.profiling import find_blocks, find_units, profile
from gradckpt.testing.example import Example
from gradckpt.testing.regnets import ConvNormAct, regnet


def _allocator_step(ex: Example) -> tuple[int, dict[str, torch.Tensor]]:
    """(parameters + the allocator's peak, gradients) of one step from a fixed seed."""
    ex.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with AllocatorTracker() as at:
        ex.loss_fn().backward()
    grads = {k: p.grad.clone() for k, p in ex.model.named_parameters()}
    ex.model.zero_grad(set_to_none=True)
    return state_bytes(ex.model) + at.peak_bytes, grads


def test_blocks_kept_as_attributes_of_plain_stages_are_found():
    ex = regnet()
    model = ex.model
    # stages.s1 holds one block: still a block, since Bottleneck repeats elsewhere.
    assert find_blocks(model) == ex.block_paths
    assert ex.block_paths[0] == "stages.s1.b1" and len(ex.block_paths) == 8
    # A bottleneck's three ConvNormAct parts (conv1..conv3) do not split it.
    assert not any(isinstance(model.get_submodule(p), ConvNormAct) for p in find_blocks(model))
    units = find_units(model, find_blocks(model))
    assert [u.path for u in units] == ["stem", *ex.block_paths, "head"]
    assert [u.path for u in units if u.is_block] == ex.block_paths


def test_regnet_least_peak_is_at_or_below_per_block_checkpointing_at_the_allocator():
    ex = regnet()
    plain, plain_grads = _allocator_step(ex)
    # Per-block checkpointing, as timm does it: every discovered block in a region.
    modules = dict(ex.model.named_modules())
    for path in ex.block_paths:
        block = modules[path]
        block.forward = (
            lambda f: lambda x: torch_checkpoint.checkpoint(f, x, use_reentrant=False)
        )(block.forward)
    try:
        per_block, _ = _allocator_step(ex)
    finally:
        for path in ex.block_paths:
            del modules[path].forward
    assert per_block < plain
    prof = profile(ex.model, ex.loss_fn, repeats=1)
    assert [u.path for u in prof.blocks] == ex.block_paths and prof.blocks_note == ""
    least = gradckpt.frontier(ex.model, ex.loss_fn, profile=prof)[0].peak_bytes
    try:
        plan = gradckpt.fit(ex.model, ex.loss_fn, least, profiling=gradckpt.ProfileOptions(profile=prof))
    except gradckpt.BudgetError as e:
        # A byte budget also holds what the step and planning take from malloc beside the
        # tensors (#40); the refusal names the budget with it, and its tensors' share is
        # the least peak again.
        plan = gradckpt.fit(ex.model, ex.loss_fn, e.least_peak_bytes, profiling=gradckpt.ProfileOptions(profile=prof))
    try:
        planned, grads = _allocator_step(ex)
    finally:
        gradckpt.remove(ex.model)
    assert planned <= per_block, (planned, per_block, plain)
    assert planned <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - planned) <= 0.02 * planned
    for k, g in plain_grads.items():
        assert torch.equal(grads[k], g), k


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class _Parts(nn.Module):
    """A block of numbered parts of one class beside an activation: parts, not a sequence."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.part1 = _Block(width)
        self.part2 = _Block(width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.part2(self.part1(x)))


def test_blocks_in_module_dicts_and_nested_plain_stages():
    by_name = nn.Module()
    by_name.layers = nn.ModuleDict({"first": _Block(4), "second": _Block(4)})
    assert find_blocks(by_name) == ["layers.first", "layers.second"]
    nested = nn.Module()
    nested.stages = nn.Module()
    for i in (1, 2):
        stage = nn.Module()
        for j in (1, 2, 3):
            stage.add_module(f"layer{j}", _Block(4))
        nested.stages.add_module(f"stage{i}", stage)
    assert find_blocks(nested) == [f"stages.stage{i}.layer{j}" for i in (1, 2) for j in (1, 2, 3)]
    chain = nn.Sequential(_Parts(4), _Parts(4))
    assert find_blocks(chain) == ["0", "1"]


class _Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(8, 8, 3, padding=1)
        self.second = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.second(torch.relu(self.first(x))))


class _NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = _Stem()
        self.body = _Body()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def test_no_blocks_found_the_budget_error_lists_the_candidates_and_blocks_arg():
    torch.manual_seed(0)
    model = _NoBlocks()
    x = torch.randn(2, 3, 16, 16)

    def loss_fn() -> torch.Tensor:
        return model(x).square().mean()

    assert find_blocks(model) == []
    prof = profile(model, loss_fn, repeats=1)
    assert "stem (_Stem)" in prof.blocks_note and "body (_Body)" in prof.blocks_note
    with pytest.raises(gradckpt.BudgetError) as err:
        gradckpt.plan(model, loss_fn, budget=prof.param_bytes + 1, profiling=gradckpt.ProfileOptions(profile=prof))
    message = str(err.value)
    assert "found no repeated blocks in _NoBlocks" in message
    assert "candidates considered: stem (_Stem), body (_Body), head (Linear)" in message
    assert "blocks=" in message
    # Named by hand, the error has nothing to add.
    named = profile(model, loss_fn, blocks=["body.first", "body.second"], repeats=1)
    assert named.blocks_note == "" and [u.path for u in named.blocks] == [
        "body.first",
        "body.second",
    ]
    # The note survives a profile file.
    assert type(prof).from_json(prof.to_json()).blocks_note == prof.blocks_note
