"""Copies of an applied model (deepcopy, copy.copy, pickle, torch.save) train their own weights."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import gradckpt
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.profiling import model_fingerprint
from gradckpt.testing import make


def _segment_plan(ex) -> Plan:
    """A plan with a region per block and a nested segment: wrappers and the root guard."""
    blocks = ex.block_paths
    items = (
        UnitChoice("inp"),
        UnitChoice(blocks[0], "recompute"),
        Segment(tuple(UnitChoice(p, "recompute") for p in blocks[1:4])),
        *(UnitChoice(p, "recompute") for p in blocks[4:]),
        UnitChoice("head"),
    )
    return Plan(items, model_fingerprint(ex.model))


def _step_grads(model, inputs, seed=3):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(inputs["x"])
    torch.nn.functional.cross_entropy(out, inputs["y"]).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def _roundtrip_pickle(model):
    return pickle.loads(pickle.dumps(model))


def _roundtrip_torch_save(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [copy.deepcopy, _roundtrip_pickle, _roundtrip_torch_save])
def test_copy_of_applied_model_trains_the_copy_not_the_original(copier):
    ex = make("dropout_mlp", blocks=6, width=16, hidden=32, batch=4)
    plain = _step_grads(copy.deepcopy(ex.model), ex.inputs)
    gradckpt.apply(ex.model, _segment_plan(ex))
    twin = copier(ex.model)
    # The copy's weights differ from the original's from here on (an EMA or a reference model).
    with torch.no_grad():
        for p in ex.model.parameters():
            p.add_(1.0)
    ex.model.zero_grad(set_to_none=True)
    grads = _step_grads(twin, ex.inputs)
    assert all(p.grad is None for p in ex.model.parameters())
    assert all(torch.equal(plain[k], grads[k]) for k in plain)
    assert gradckpt.applied_plan(twin) == gradckpt.applied_plan(ex.model)
    gradckpt.remove(twin)
    assert all("forward" not in m.__dict__ for m in twin.modules())
    assert gradckpt.applied_plan(ex.model) is not None  # the original keeps its plan
    gradckpt.remove(ex.model)


def test_shallow_copy_of_applied_model_shares_the_original_modules():
    ex = make("mlp", blocks=6, width=16, hidden=32, batch=4)
    plain = _step_grads(copy.deepcopy(ex.model), ex.inputs)
    gradckpt.apply(ex.model, _segment_plan(ex))
    twin = copy.copy(ex.model)
    grads = _step_grads(twin, ex.inputs)
    assert all(torch.equal(plain[k], grads[k]) for k in plain)
    gradckpt.remove(ex.model)


def test_deepcopy_of_applied_block_alone_trains_the_copied_block():
    ex = make("mlp", blocks=6, width=16, hidden=32, batch=4)
    gradckpt.apply(ex.model, _segment_plan(ex))
    block = copy.deepcopy(ex.model.blocks[0])
    x = torch.randn(4, 16, requires_grad=True)
    block(x).sum().backward()
    assert all(p.grad is not None for p in block.parameters())
    assert all(p.grad is None for p in ex.model.blocks[0].parameters())
    gradckpt.remove(ex.model)
