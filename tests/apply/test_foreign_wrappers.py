"""remove() keeps a forward wrapper another library installed after apply."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

import gradckpt
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.profiling import model_fingerprint
from gradckpt.testing import make


def _plan(ex) -> Plan:
    b = ex.block_paths
    items = (UnitChoice("inp"), UnitChoice(b[0], "recompute"),
             Segment((UnitChoice(b[1]), UnitChoice(b[2]))), UnitChoice("head"))  # fmt: skip
    return Plan(items, model_fingerprint(ex.model))


def _wrap_like_a_library(module, calls):
    """As accelerate's hooks do: a new forward that calls the one it found."""
    found = module.forward

    def forward(*args, **kwargs):
        calls.append(type(module).__name__)
        return found(*args, **kwargs)

    module.forward = functools.update_wrapper(forward, found, assigned=(), updated=())


def _step(model, inputs):
    """Gradients of one step, and how many times the blocks' first linear ran (2x: recomputed)."""
    fc1_calls = []
    handles = [b.fc1.register_forward_hook(lambda *a: fc1_calls.append(1)) for b in model.blocks]
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(inputs["x"]), inputs["y"]).backward()
    for h in handles:
        h.remove()
    return {k: p.grad for k, p in model.named_parameters()}, len(fc1_calls)


def test_remove_keeps_a_forward_wrapper_installed_after_apply_and_runs_plainly():
    ex = make("mlp", blocks=3, width=16, hidden=32, batch=4)
    plain, plain_calls = _step(copy.deepcopy(ex.model), ex.inputs)
    gradckpt.apply(ex.model, _plan(ex))
    calls: list[str] = []
    for module in (ex.model.blocks[0], ex.model.blocks[1], ex.model):
        _wrap_like_a_library(module, calls)
    theirs = ex.model.blocks[0].forward
    assert _step(ex.model, ex.inputs)[1] > plain_calls  # checkpointed: blocks recompute
    gradckpt.remove(ex.model)
    assert gradckpt.applied_plan(ex.model) is None
    assert ex.model.blocks[0].forward is theirs  # their wrapper is kept ...
    calls.clear()
    grads, fc1_calls = _step(ex.model, ex.inputs)
    assert fc1_calls == plain_calls  # ... and nothing is checkpointed any more
    assert calls.count("ResidualMLPBlock") == 2 and calls.count("MLP") == 1
    assert all(torch.equal(plain[k], grads[k]) for k in plain)
