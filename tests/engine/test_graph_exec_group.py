"""``torch.utils.checkpoint.GraphExecGroup`` is honoured as torch honours it.

A backward split into several ``autograd.grad`` calls (pipeline schedules that
compute input gradients and weight gradients separately) recomputes each region
once for the whole group, not once per call; two calls in one group that need
the same saved tensor are refused, since the first consumed it.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError as TorchCheckpointError

import gradckpt

GraphExecGroup = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
pytestmark = pytest.mark.skipif(GraphExecGroup is None, reason="this torch has no GraphExecGroup")


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, a, b):
        self.calls += 1
        return torch.tanh(self.lin(a)) * b.cos(), b.exp().sin()


def plain_grads(model, a, b):
    o1, o2 = model(a, b)
    return (
        torch.autograd.grad(o1.sum(), [a, model.lin.weight], retain_graph=True),
        torch.autograd.grad(o2.sum(), [b]),
    )


def test_split_backward_in_a_group_recomputes_once_with_plain_gradients():
    model = Counted()
    a, b = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    o1, o2 = gradckpt.checkpoint(model, a, b)
    with GraphExecGroup():
        g1 = torch.autograd.grad(o1.sum(), [a, model.lin.weight], retain_graph=True)
        g2 = torch.autograd.grad(o2.sum(), [b], retain_graph=True)
    assert model.calls == 2  # the forward and one recompute
    ref1, ref2 = plain_grads(model, a, b)
    for got, ref in zip((*g1, *g2), (*ref1, *ref2), strict=True):
        assert torch.equal(got, ref)


def test_without_a_group_each_call_recomputes():
    model = Counted()
    a, b = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    o1, o2 = gradckpt.checkpoint(model, a, b)
    torch.autograd.grad(o1.sum(), [a], retain_graph=True)
    torch.autograd.grad(o2.sum(), [b], retain_graph=True)
    assert model.calls == 3


def test_overlapping_calls_in_a_group_are_refused_with_torch_words():
    model = Counted()
    a, b = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    o1, _ = gradckpt.checkpoint(model, a, b)
    with GraphExecGroup():
        torch.autograd.grad(o1.sum(), [a], retain_graph=True)
        with pytest.raises(
            TorchCheckpointError, match="Performing two backward calls that overlap"
        ):
            torch.autograd.grad(o1.sum(), [a], retain_graph=True)


def test_each_group_is_its_own_pass_and_is_forgotten_when_gone():
    model = Counted()
    frames = []

    def fn(a, b):
        frames.append(gradckpt.engine.active_frame())
        return model(a, b)

    a, b = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    o1, o2 = gradckpt.checkpoint(fn, a, b)
    frame = frames[0][0]
    live = [h for h in (ref() for ref in frame.slots if ref is not None) if h is not None]
    for _ in range(2):
        with GraphExecGroup():
            torch.autograd.grad(o1.sum(), [a], retain_graph=True)  # o2's tensors stay unread
            assert any(h.values for h in live)  # recomputed, unread: held while the group lives...
        gc.collect()
        assert not any(h.values for h in live)  # ...and dropped once it is gone
    assert model.calls == 3  # one recompute per group
    torch.autograd.grad(o2.sum(), [b])  # still complete for a later backward
