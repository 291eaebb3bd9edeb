"""Saved inputs that take no gradient come back as the objects themselves, as in torch.

Quantized frozen weights carry their quantization state as Python attributes
on the ``nn.Parameter`` object (the QLoRA pattern), and their custom
``autograd.Function`` reads it back from ``ctx.saved_tensors`` in backward. A
detached copy would be a plain tensor without those attributes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt import policies


class QuantMatmul(torch.autograd.Function):
    """``x @ dequant(w)``; backward needs ``w``'s quantization state."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.w_id = id(w)
        return x @ (w * w.quant_scale).t()

    @staticmethod
    def backward(ctx, grad):
        _, w = ctx.saved_tensors
        ctx.seen = (id(w) == ctx.w_id, type(w), getattr(w, "quant_scale", None))
        return grad @ (w * w.quant_scale), None


def frozen_weight() -> nn.Parameter:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    w.quant_scale = 0.5
    return w


def seen_in_backward(out: torch.Tensor) -> tuple:
    node = out.grad_fn
    while type(node).__name__ != "QuantMatmulBackward":
        node = node.next_functions[0][0]
    out.sum().backward()
    return node.seen


@pytest.mark.parametrize("policy", [None, policies.save_matmuls], ids=["plain", "policy"])
def test_frozen_parameter_saved_by_a_custom_function_keeps_identity_type_and_attributes(policy):
    w = frozen_weight()
    x = torch.randn(3, 4, requires_grad=True)

    def block(t, weight):
        return QuantMatmul.apply(t.sin(), weight)

    out = gradckpt.checkpoint(lambda t, weight: block(t, weight).exp(), x, w, policy=policy)
    # the Function runs again in the recompute and saves the weight again there
    assert seen_in_backward(out.sin()) == (True, nn.Parameter, 0.5)
    ref = x.grad.clone()
    x.grad = None
    block(x, w).exp().sin().sum().backward()
    assert torch.equal(x.grad, ref)


def test_identity_kept_in_a_region_nested_in_a_recompute():
    w = frozen_weight()
    x = torch.randn(3, 4, requires_grad=True)

    def inner(t, weight):
        return QuantMatmul.apply(t, weight).tanh()

    def outer(t, weight):
        return gradckpt.checkpoint(inner, t.cos(), weight).exp()

    out = gradckpt.checkpoint(outer, x, w)
    assert seen_in_backward(out) == (True, nn.Parameter, 0.5)


def test_a_frozen_tensor_input_is_the_same_object_inside_the_recompute():
    seen = []
    mask = torch.tensor([1.0, 0.0, 1.0])
    mask.tag = "attention-mask"

    def fn(x, m):
        seen.append(m)
        return (x * m).sin()

    x = torch.randn(3, requires_grad=True)
    gradckpt.checkpoint(fn, x, mask).sum().backward()
    assert len(seen) == 2 and all(m is mask for m in seen)


def test_inputs_that_take_gradients_still_get_them_and_are_not_written():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    frozen = frozen_weight()
    x = torch.randn(2, 4, requires_grad=True)
    before = frozen.detach().clone()
    out = gradckpt.checkpoint(lambda t, w: lin(QuantMatmul.apply(t, w)).relu(), x, frozen)
    out.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None and frozen.grad is None
    assert torch.equal(frozen, before)
