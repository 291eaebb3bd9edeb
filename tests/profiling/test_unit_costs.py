"""A profile times one of the model's own blocks (issue #31): its forward as a region and
with a policy; the model is left as found, and a block that cannot run alone is skipped."""

from __future__ import annotations

import json

import torch
from torch import nn

import gradckpt
from gradckpt.measure.engine_costs import EngineCosts
from gradckpt.profiling import calibration
from gradckpt.testing import make


def test_a_profile_times_its_first_block_as_regions(one_thread):
    ex = make("gpt", layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=2)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    costs = prof.engine_costs
    first_block = next(u.path for u in prof.units if u.is_block)
    assert costs.unit == first_block
    assert costs.unit_region > 0
    # Saved and loaded with the profile; a file from before these fields still loads.
    data = json.loads(json.dumps(prof.to_json()))
    assert gradckpt.Profile.from_json(data).engine_costs == costs
    for name in ("unit", "unit_region", "unit_policy"):
        del data["engine_costs"][name]
    old = gradckpt.Profile.from_json(data).engine_costs
    assert old.unit == "" and old.unit_region == 0.0
    # One from before the plain timing was dropped still loads, without it.
    data["engine_costs"]["unit_plain"] = 0.004
    assert gradckpt.Profile.from_json(data).engine_costs == old


def test_timing_the_block_leaves_weights_grads_buffers_and_rng_as_found(one_thread):
    ex = make("bn_convnet")
    calibration.forget()  # time the block now, not from an earlier test's profile
    params = {n: p.detach().clone() for n, p in ex.model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in ex.model.named_buffers()}
    rng = torch.get_rng_state()
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    assert prof.engine_costs.unit  # it did time a block (BatchNorm inside: running stats move)
    assert all(torch.equal(p, params[n]) for n, p in ex.model.named_parameters())
    assert all(p.grad is None for p in ex.model.parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in ex.model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)


class _Needy(nn.Module):
    """A block that only runs inside its parent's forward (reads what the parent set)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError("called outside the model")
        return torch.relu(self.lin(x)) * self.scale


class _Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Needy(), _Needy()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            block.scale = 2.0
            x = block(x)
            block.scale = None
        return x


def test_a_block_that_cannot_run_alone_keeps_the_tiny_chains_costs(one_thread):
    model, x = _Parent(), torch.randn(4, 8)
    calibration.forget()
    prof = gradckpt.profile(model, lambda: model(x).sum(), repeats=1)
    assert any(u.is_block for u in prof.units)
    assert prof.engine_costs.unit == "" and prof.engine_costs.unit_region == 0.0
    assert prof.engine_costs.recompute_op > 0  # the tiny chains' costs are still there


def test_a_fake_profile_times_nothing():
    ex = make("gpt", layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=2)
    prof = gradckpt.profile(ex.model, ex.loss_fn, fake=True)
    assert prof.engine_costs.unit == ""
    assert prof.engine_costs == EngineCosts(device=prof.engine_costs.device) or (
        prof.engine_costs.unit_region == 0.0
    )
