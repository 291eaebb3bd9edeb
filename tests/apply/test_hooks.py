"""Module hooks on units inside a segment: the recompute runs what the forward ran."""

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
    items = (UnitChoice("inp"), UnitChoice(b[0]),
             Segment(tuple(UnitChoice(p) for p in b[1:5])), UnitChoice(b[5]), UnitChoice("head"))  # fmt: skip
    return Plan(items, model_fingerprint(ex.model))


def _double_output_in_place(module, args, out):
    out.mul_(2.0)


def _halve_input_in_place(module, args):
    args[0].mul_(0.5)


def _scale_output(module, args, out):
    return out * 3.0


def _shift_input(module, args):
    return (args[0] + 1.0,)


def _count(calls):
    def hook(module, args):
        calls.append(1)

    return hook


HOOKS = {
    "in-place forward hook, middle unit": ("blocks.2", "forward", _double_output_in_place),
    "in-place pre-hook, middle unit": ("blocks.3", "pre", _halve_input_in_place),
    "in-place pre-hook, last unit": ("blocks.4", "pre", _halve_input_in_place),
    "in-place forward hook, first unit": ("blocks.1", "forward", _double_output_in_place),
    "out-of-place forward hook, middle unit": ("blocks.2", "forward", _scale_output),
    "out-of-place pre-hook, middle unit": ("blocks.3", "pre", _shift_input),
    "out-of-place pre-hook, last unit": ("blocks.4", "pre", _shift_input),
}


def _register(model, where, kind, hook):
    module = model.get_submodule(where)
    if kind == "forward":
        return module.register_forward_hook(hook)
    return module.register_forward_pre_hook(hook)


def _grads(ex, model):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    out = model(ex.inputs["x"])
    nn.functional.cross_entropy(out, ex.inputs["y"]).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("registered", ["before apply", "after apply"])
@pytest.mark.parametrize("case", list(HOOKS))
def test_hook_editing_an_activation_inside_a_segment_gives_plain_gradients(case, registered):
    ex = make("dropout_mlp", blocks=6, width=16, hidden=32, batch=4)
    where, kind, hook = HOOKS[case]
    plain_model = copy.deepcopy(ex.model)
    _register(plain_model, where, kind, hook)
    plain = _grads(ex, plain_model)
    if registered == "before apply":
        _register(ex.model, where, kind, hook)
        gradckpt.apply(ex.model, _segment_plan(ex))
    else:
        gradckpt.apply(ex.model, _segment_plan(ex))
        _register(ex.model, where, kind, hook)
    got = _grads(ex, ex.model)
    assert all(torch.equal(plain[k], got[k]) for k in plain), case
    assert active_frame() is None
    gradckpt.remove(ex.model)


def test_first_unit_pre_hook_runs_once_per_step_as_in_the_forward():
    # The first unit's pre-hook ran before its segment opened: the recompute,
    # which starts from the hooked inputs, must not apply it again.
    ex = make("mlp", blocks=6, width=16, hidden=32, batch=4)
    plain_model = copy.deepcopy(ex.model)
    plain_model.blocks[1].register_forward_pre_hook(_halve_input_in_place)
    plain = _grads(ex, plain_model)
    gradckpt.apply(ex.model, _segment_plan(ex))
    calls: list[int] = []
    ex.model.blocks[1].register_forward_pre_hook(_halve_input_in_place)
    ex.model.blocks[1].register_forward_pre_hook(_count(calls))
    got = _grads(ex, ex.model)
    assert all(torch.equal(plain[k], got[k]) for k in plain)
    assert len(calls) == 1
    gradckpt.remove(ex.model)
