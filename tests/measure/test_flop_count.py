"""count_flops and count_ops: exact counts for a Linear, backward included."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.measure import FlopCount, count_flops, count_ops

B, IN, OUT = 32, 16, 8


@pytest.fixture
def lin() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(IN, OUT)


def test_linear_forward_flops_are_2_b_in_out(lin):
    fc = count_flops(lin, torch.randn(B, IN))
    assert fc == FlopCount(total=2 * B * IN * OUT, by_op={"aten.addmm": 2 * B * IN * OUT})
    assert fc["aten.addmm"] == 8192
    assert fc["aten.mm"] == 0


def test_forward_backward_is_three_forwards_when_the_input_needs_grad(lin):
    x = torch.randn(B, IN, requires_grad=True)
    fc = count_flops(lambda: lin(x).sum().backward())
    forward = 2 * B * IN * OUT
    assert fc.total == 3 * forward
    assert fc.by_op == {"aten.addmm": forward, "aten.mm": 2 * forward}  # grad_input, grad_weight


def test_kwargs_reach_fn():
    a, b = torch.ones(2, 3), torch.ones(3, 5)
    assert count_flops(torch.matmul, a, other=b).total == 2 * 2 * 3 * 5


def test_flop_count_is_frozen():
    fc = FlopCount(total=1, by_op={"aten.mm": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        fc.total = 2


def test_count_ops_sees_backward_and_skips_metadata_ops(lin):
    x = torch.randn(B, IN, requires_grad=True)
    ops = count_ops(lambda: lin(x).sum().backward())
    assert ops["aten.addmm.default"] == 1
    assert ops["aten.mm.default"] == 2
    assert ops["aten.sum.default"] == 1  # the loss
    assert ops["aten.sum.dim_IntList"] == 1  # grad of the bias
    # AccumulateGrad detaches each new .grad; the engine does not number detaches.
    assert "aten.detach.default" not in ops
    assert all(name.startswith("aten.") and name.count(".") == 2 for name in ops)


def test_count_ops_sees_the_recompute(lin):
    x = torch.randn(B, IN, requires_grad=True)
    ops = count_ops(lambda: gradckpt.checkpoint(lambda t: torch.tanh(lin(t)), x).sum().backward())
    assert ops["aten.addmm.default"] == 2  # forward + recompute
    assert ops["aten.tanh.default"] == 2
    assert ops["aten.mm.default"] == 2
