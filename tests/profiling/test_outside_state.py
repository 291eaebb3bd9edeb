"""Profiling leaves everything the step touched as found, also outside the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.profiling import profile
from gradckpt.testing import make


def _outside_world(ex):
    """A loss head with a BatchNorm, a learnable prompt and an input that requires grad."""
    torch.manual_seed(5)
    head = nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1)).train()
    prompt = nn.Parameter(torch.randn(ex.inputs["x"].shape[1]) * 0.01)
    x = ex.inputs["x"].clone().requires_grad_(True)
    calls = []

    def loss_fn():
        calls.append(1)
        return head(ex.model(x + prompt)).pow(2).mean()

    # Gradients already there (an accumulation step in progress) must survive.
    loss_fn().backward()
    calls.clear()
    return head, prompt, x, loss_fn, calls


def _snapshot(head, prompt, x):
    tensors = {"prompt": prompt, "x": x, **dict(head.named_parameters())}
    grads = {k: (t.grad, t.grad.clone()) for k, t in tensors.items()}
    buffers = {k: b.clone() for k, b in head.named_buffers()}
    return tensors, grads, buffers


def _assert_unchanged(head, tensors, grads, buffers):
    for k, t in tensors.items():
        obj, value = grads[k]
        assert t.grad is obj and torch.equal(t.grad, value), f"gradient of {k} changed"
    for k, b in head.named_buffers():
        assert torch.equal(b, buffers[k]), f"buffer {k} changed"


@pytest.mark.parametrize("repeats", [1, 3])
def test_profiling_leaves_gradients_and_buffers_outside_the_model_as_found(repeats):
    ex = make("mlp", blocks=3, width=16, hidden=32, batch=8)
    head, prompt, x, loss_fn, calls = _outside_world(ex)
    tensors, grads, buffers = _snapshot(head, prompt, x)
    assert int(head[1].num_batches_tracked) == 1
    profile(ex.model, loss_fn, repeats=repeats)
    _assert_unchanged(head, tensors, grads, buffers)
    assert int(head[1].num_batches_tracked) == 1
    # As the docstring says: one forward-only pass, then `repeats` recorded and `repeats` timed steps.
    assert len(calls) == 1 + 2 * repeats


def test_plan_leaves_outside_state_as_found():
    ex = make("mlp", blocks=3, width=16, hidden=32, batch=8)
    head, prompt, x, loss_fn, _ = _outside_world(ex)
    tensors, grads, buffers = _snapshot(head, prompt, x)
    gradckpt.plan(ex.model, loss_fn, budget=1.0, profiling=gradckpt.ProfileOptions(repeats=1))
    _assert_unchanged(head, tensors, grads, buffers)


def test_outside_leaf_without_gradient_stays_without():
    ex = make("mlp", blocks=2, width=16, hidden=32, batch=8)
    prompt = nn.Parameter(torch.zeros(16))
    profile(ex.model, lambda: ex.model(ex.inputs["x"] + prompt).sum(), repeats=1)
    assert prompt.grad is None
