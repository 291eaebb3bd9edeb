"""Block discovery finds what a person would call the blocks, on layouts from libraries in the wild.

The module trees are those of :mod:`gradckpt.testing.wild` (torchtitan's Llama,
a mixture of experts, litgpt, Swin stages, MONAI's recursive U-Net) and the zoo;
the checks run discovery as ``profile`` does (the step's forward settles nested
levels), then hold the fitted plan to the allocator at the every-block peak.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import iter_units
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.profiling import find_blocks, profile
from gradckpt.profiling.block_cover import COVER_SHARE, nested, settle_nested, written_by_module
from gradckpt.profiling.units import block_candidates
from gradckpt.testing import ZOO, make
from gradckpt.testing.wild import WILD, torchtitan_sac, wild


class Linear(nn.Linear):
    pass


class FFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(8, 24), Linear(24, 8), Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.ffn = FFN()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


def test_numbered_parts_of_a_torch_layer_subclass_do_not_split_their_block():
    net = nn.Module()
    net.layers = nn.ModuleList(Block() for _ in range(4))
    assert find_blocks(net) == [f"layers.{i}" for i in range(4)]
    # Alone (no block around them), such layers are the blocks.
    assert find_blocks(nn.Sequential(Linear(8, 8), Linear(8, 8))) == ["0", "1"]


def _settled(ex) -> list[str]:
    prof = profile(ex.model, ex.loss_fn, fake=True)
    return [u.path for u in prof.blocks]


@pytest.mark.parametrize("name", WILD)
def test_profile_finds_the_blocks_of_layouts_in_the_wild(name):
    ex = wild(name)
    assert _settled(ex) == ex.block_paths


@pytest.mark.parametrize("name", sorted(ZOO))
def test_the_zoo_keeps_its_blocks(name):
    ex = make(name)
    assert _settled(ex) == ex.block_paths


def test_experts_inside_a_layer_leave_its_routing_outside_every_unit_so_the_layer_is_the_block():
    ex = wild("moe_llama")
    candidates = block_candidates(ex.model)
    assert nested(candidates)
    assert find_blocks(ex.model)[0] == "layers.0.feed_forward.experts.0"  # structure alone
    written = written_by_module(ex.model, ex.loss_fn)
    layer = sum(n for p, n in written.items() if p.startswith("layers.0"))
    experts = sum(n for p, n in written.items() if p.startswith("layers.0.feed_forward.experts."))
    assert experts < COVER_SHARE * layer  # the routing and the attention are the rest
    blocks, parents = settle_nested(ex.model, candidates, ex.loss_fn)
    assert blocks == ex.block_paths and parents == []


def test_swin_stages_keep_their_blocks_and_are_named_as_parents():
    ex = wild("timm_swin")
    blocks, parents = settle_nested(ex.model, block_candidates(ex.model), ex.loss_fn)
    assert blocks == ex.block_paths
    assert parents == ["layers.0", "layers.1"]
    prof = profile(ex.model, ex.loss_fn, fake=True)
    assert prof.block_parents == ("layers.0", "layers.1")
    assert type(prof).from_json(prof.to_json()).block_parents == prof.block_parents


def test_a_peak_outside_the_units_names_the_parents_in_the_budget_error():
    # Blocks named by hand at the projections (as discovery once found them): the
    # block's own code is outside every unit, and the least peak is there.
    ex = wild("titan_llama", layers=2)
    projections = [p for p, _ in ex.model.named_modules() if p.endswith((".w1", ".w2", ".w3"))]
    prof = profile(ex.model, ex.loss_fn, fake=True, blocks=projections)
    with_parents = dataclasses.replace(prof, block_parents=("layers.0", "layers.1"))
    with pytest.raises(BudgetError) as caught:
        # Without chunking: a chunked head and loss would move the least peak to the head.
        Planner(with_parents, chunking=False).plan(1)
    message = str(caught.value)
    assert "outside the planned units" in message
    assert "layers.0, layers.1" in message and "blocks=" in message
    with pytest.raises(BudgetError) as plain_error:
        Planner(prof, chunking=False).plan(1)
    assert "repeated modules" not in str(plain_error.value)


@pytest.mark.usefixtures("one_thread")
def test_fit_at_the_every_block_peak_of_a_torchtitan_llama_holds_it_at_the_allocator(
    peak_and_grads, every_block_peak
):
    ex = wild("titan_llama", layers=4, dim=64, seq=128, batch=2)
    plain_peak, plain_grads = peak_and_grads(ex.model, ex.loss_fn)
    budget = every_block_peak(ex)
    assert budget < 0.6 * plain_peak
    # chunking=False: gradients bit for bit, as torch's per-block checkpointing gives them.
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget, chunking=False)
    assert {u.path for u in iter_units(plan.items)} >= set(ex.block_paths)
    peak, grads = peak_and_grads(ex.model, ex.loss_fn)
    assert peak <= budget, (peak, budget)
    assert all(torch.equal(grads[k], plain_grads[k]) for k in plain_grads)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "t5"])
def test_hugging_face_models_keep_their_decoder_and_encoder_layers(name):
    pytest.importorskip("transformers")
    from gradckpt.integrations.hf.zoo import hf_example

    ex = hf_example(name, layers=2, hidden=32, heads=2, seq=16, batch=2, vocab=64)
    assert _settled(ex) == ex.block_paths


@pytest.mark.usefixtures("one_thread")
def test_fit_at_the_peak_of_torchtitans_selective_checkpointing_holds_it(peak_and_grads):
    ex = wild("titan_llama", layers=4, dim=64, seq=128, batch=2)
    plain_peak, plain_grads = peak_and_grads(ex.model, ex.loss_fn)
    modules = dict(ex.model.named_modules())
    for path in ex.block_paths:
        modules[path].forward = torchtitan_sac(modules[path].forward)
    try:
        budget, sac_grads = peak_and_grads(ex.model, ex.loss_fn)
    finally:
        for path in ex.block_paths:
            modules[path].__dict__.pop("forward")
    assert budget < plain_peak and all(torch.equal(sac_grads[k], plain_grads[k]) for k in sac_grads)
    gradckpt.fit(ex.model, ex.loss_fn, budget, chunking=False)  # bit for bit, as SAC's
    peak, grads = peak_and_grads(ex.model, ex.loss_fn)
    assert peak <= budget, (peak, budget)
    assert all(torch.equal(grads[k], plain_grads[k]) for k in plain_grads)
