"""Calling part of an applied model runs correctly and leaves nothing open on the thread."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.engine import active_frame
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.profiling import model_fingerprint
from gradckpt.testing import make


def _segment_plan(ex) -> Plan:
    b = ex.block_paths
    inner = (UnitChoice(b[1], "recompute"), UnitChoice(b[2]), UnitChoice(b[3], "recompute"))
    items = (UnitChoice("inp"), UnitChoice(b[0], "recompute"), Segment(inner),
             UnitChoice(b[4]), UnitChoice("head"))  # fmt: skip
    return Plan(items, model_fingerprint(ex.model))


def _grads(module, fn, seed=2):
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    fn().sum().backward()
    out = {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return out


def _full_step(ex):
    return lambda: nn.functional.cross_entropy(ex.model(ex.inputs["x"]), ex.inputs["y"])


PARTS = {
    "first unit of a segment alone": lambda m, x: m.blocks[1](x),
    "middle unit of a segment alone": lambda m, x: m.blocks[2](x),
    "a slice across the segment": lambda m, x: nn.Sequential(*m.blocks[:3])(x),
    "the segment's units in order, outside the model": lambda m, x: m.blocks[3](
        m.blocks[2](m.blocks[1](x))
    ),
}


@pytest.mark.parametrize("part", list(PARTS))
def test_partial_call_of_applied_model_is_exact_and_never_poisons_the_thread(part):
    ex = make("dropout_mlp", blocks=5, width=16, hidden=32, batch=4)
    x = torch.randn(4, 16)
    call = PARTS[part]
    plain_model = copy.deepcopy(ex.model)
    plain_part = _grads(plain_model, lambda: call(plain_model, x))
    plain_step = _grads(ex.model, _full_step(ex))
    gradckpt.apply(ex.model, _segment_plan(ex))
    got = _grads(ex.model, lambda: call(ex.model, x))
    assert active_frame() is None
    assert got.keys() == plain_part.keys()
    assert all(torch.equal(got[k], plain_part[k]) for k in got)
    step = _grads(ex.model, _full_step(ex))  # later full steps still right
    assert all(torch.equal(step[k], plain_step[k]) for k in plain_step)
    gradckpt.remove(ex.model)
    assert active_frame() is None


def test_forward_stopped_by_a_hook_inside_a_segment_leaves_nothing_open():
    ex = make("mlp", blocks=5, width=16, hidden=32, batch=4)
    gradckpt.apply(ex.model, _segment_plan(ex))
    seen = []

    class Stop(Exception):
        pass

    def grab(module, args, out):
        seen.append(out)
        raise Stop

    handle = ex.model.blocks[2].register_forward_hook(grab)
    with pytest.raises(Stop):
        ex.model(ex.inputs["x"])
    handle.remove()
    assert active_frame() is None and len(seen) == 1
    _full_step(ex)().backward()
    gradckpt.remove(ex.model)
