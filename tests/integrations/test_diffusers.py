"""diffusers U-Nets under gradckpt: blocks found, budget held, exact gradients.

``UNet2DModel`` (pixels, self-attention) and ``UNet2DConditionModel`` (latents,
cross-attention) from small configs with random weights, dropout on. The skip
tensors (down blocks' outputs read by the up blocks) are live across the middle
of the network; the measured peak equal to the predicted one shows the plan
counts them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import gradckpt
from gradckpt.integrations.diffusers_unet import unet_blocks
from gradckpt.integrations.diffusers_zoo import unet_example
from gradckpt.integrations.hf.zoo import run_step
from gradckpt.profiling.units import find_blocks

BUDGET = 0.7


pytestmark = pytest.mark.usefixtures("one_thread")


SIZES = {
    "unet2d": dict(sample=32, channels=(32, 64, 64)),
    "unet2d_condition": dict(sample=32, channels=(32, 64)),
}


@pytest.mark.parametrize("name", list(SIZES))
def test_blocks_are_the_resnets_attentions_and_samplers_of_every_down_mid_up_block(name):
    model = unet_example(name, **SIZES[name]).model
    blocks = find_blocks(model)
    assert blocks == unet_blocks(model)
    kinds = {path.split(".")[-2] for path in blocks}
    assert kinds == {"resnets", "attentions", "downsamplers", "upsamplers"}
    modules = dict(model.named_modules())
    # Every down, mid and up block is covered, and nothing inside a unit is a unit too.
    holders = [f"down_blocks.{i}" for i in range(len(model.down_blocks))]
    holders += ["mid_block"] + [f"up_blocks.{i}" for i in range(len(model.up_blocks))]
    for holder in holders:
        assert any(path.startswith(holder + ".") for path in blocks), holder
    assert not any(a != b and b.startswith(a + ".") for a in blocks for b in blocks)
    # Cross-attention is a unit as a whole (the generic rule found its GELU projection).
    if name == "unet2d_condition":
        assert type(modules["mid_block.attentions.0"]).__name__ == "Transformer2DModel"
        assert "mid_block.attentions.0" in blocks


@pytest.mark.parametrize("name", list(SIZES))
def test_fit_holds_the_budget_with_exact_gradients(name):
    ex = unet_example(name, **SIZES[name])
    plain = run_step(ex)
    plan = gradckpt.fit(ex.model, ex.loss_fn, BUDGET, profiling=gradckpt.ProfileOptions(repeats=1))
    assert any(u.mode != "keep" for u in plan.units) or any(
        isinstance(i, gradckpt.Segment) for i in plan.items
    )
    planned = run_step(ex)
    assert torch.equal(planned.loss, plain.loss)
    assert planned.grads.keys() == plain.grads.keys()
    for k, g in plain.grads.items():
        assert torch.equal(planned.grads[k], g), k
    assert planned.peak_bytes <= plan.budget_bytes
    # The simulator predicts the measured peak (within 2%; plans vary with op timings).
    assert abs(planned.peak_bytes - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes
    assert plan.budget_bytes < plain.peak_bytes


def test_a_plain_module_is_not_a_diffusers_model():
    assert unet_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == []
