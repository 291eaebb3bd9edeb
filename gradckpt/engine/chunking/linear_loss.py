"""A linear head and its cross-entropy, slice by slice, with its gradients accumulated in place.

The general route (:func:`~gradckpt.engine.chunking.slices.chunked_sum`: each
slice a checkpointed region) lets autograd gather a weight's gradient, so every
slice after the first makes a whole ``(V, H)`` gradient before adding it: one
weight's worth on top of the slice. For the usual head, an ``nn.Linear``, this
autograd function does the linear part of backward itself: each slice's
``dL/dlogits`` comes from autograd on the slice's own loss (so label smoothing,
``ignore_index`` and z-loss are torch's), then ``grad_hidden[slice] = g @ W``
into one buffer and ``grad_W += g^T @ h`` in place. Nothing is saved but the
inputs; the logits of one slice live at a time, in forward and backward.

Example:
    >>> loss_sum = linear_cross_entropy_sum(h, LinearHead(w, b), y, 8, settings)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gradckpt.engine.chunking.slices import token_slices

__all__ = ["LinearHead", "linear_cross_entropy_sum"]


class LinearHead:
    """``F.linear(x, weight, bias)``: a head whose backward the chunked loss may do itself."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _compute(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The operands as autocast would hand them to the matmul (``dtype``: its dtype)."""
    if dtype is None:
        return x, w, b
    return x.to(dtype), w.to(dtype), b.to(dtype) if b is not None else None


class _Tap(torch.autograd.Function):
    """Identity on ``logits`` whose backward hands their gradient to ``box`` instead.

    The slice's logits then need no leaf of their own (a leaf keeps its data alive
    for its gradient): they die as soon as the loss's graph no longer reads them,
    as they would in the plain step.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, logits: torch.Tensor, box: list) -> torch.Tensor:  # type: ignore[override]
        ctx.box = box
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        ctx.box.append(grad)
        return None, None, None


def _slice_grad(
    loss: Any, rows: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
    labels: torch.Tensor, scale: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``d(scale * loss(logits)) / d logits`` for one slice's ``rows``, by autograd on
    torch's own loss (the logits made here, so nothing else holds them)."""
    anchor = torch.zeros((), requires_grad=True)
    box: list[torch.Tensor] = []
    with torch.enable_grad():
        logits = _Tap.apply(anchor, F.linear(rows, w, b).detach(), box)
        part = loss.from_logits(logits, labels).float()
        del logits
    torch.autograd.backward(part, scale, inputs=[anchor])
    return box[0]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        labels: torch.Tensor, chunks: int, loss: Any,
    ) -> torch.Tensor:  # fmt: skip
        dtype = loss.autocast[1] if loss.autocast is not None else None
        x, w, b = _compute(hidden, weight, bias, dtype)
        total = None
        for start, stop in token_slices(hidden.shape[0], chunks):
            part = loss.from_logits(F.linear(x[start:stop], w, b), labels[start:stop]).float()
            total = part if total is None else total + part
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunks, ctx.loss, ctx.dtype = chunks, loss, dtype
        assert total is not None
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple:  # type: ignore[override]
        hidden, weight, bias, labels = ctx.saved_tensors
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
        x, w, b = _compute(hidden, weight, bias, ctx.dtype)
        grad_x = torch.empty_like(x) if needs_x else None
        grad_w = grad_b = None
        for start, stop in token_slices(hidden.shape[0], ctx.chunks):
            g = _slice_grad(ctx.loss, x[start:stop], w, b, labels[start:stop], grad_total)
            if grad_x is not None:
                torch.mm(g, w, out=grad_x[start:stop])
            if needs_w:
                rows = x[start:stop]
                if g.dtype != weight.dtype:  # autocast: multiply in the weight's dtype, so
                    g, rows = g.to(weight.dtype), rows.to(weight.dtype)  # no (V, H) bf16 copy
                if grad_w is None:
                    grad_w = g.t().mm(rows)
                else:
                    grad_w.addmm_(g.t(), rows)
            if needs_b:
                part_b = g.sum(0, dtype=bias.dtype)
                grad_b = part_b if grad_b is None else grad_b.add_(part_b)
            del g
        if grad_x is not None and grad_x.dtype != hidden.dtype:
            grad_x = grad_x.to(hidden.dtype)
        return grad_x, grad_w, grad_b, None, None, None


def linear_cross_entropy_sum(
    rows: torch.Tensor, head: LinearHead, labels: torch.Tensor, chunks: int, loss: Any
) -> torch.Tensor:
    """The summed loss ``loss.from_logits`` gives over ``chunks`` slices, as float32.

    ``rows``: ``(N, H)``; ``labels``: ``(N,)``; ``loss``: the per-slice loss settings
    (:class:`~gradckpt.engine.chunking.cross_entropy._SliceLoss`).

    Example:
        >>> linear_cross_entropy_sum(h, LinearHead(lm_head.weight), y, 4, settings)
    """
    return _LinearCrossEntropy.apply(rows, head.weight, head.bias, labels, chunks, loss)
