"""A linear head and its cross-entropy, slice by slice, with its gradients accumulated in place.

The general route (:func:`~gradckpt.engine.chunking.slices.chunked_sum`: each
slice a checkpointed region) lets autograd gather a weight's gradient, so every
slice after the first makes a whole ``(V, H)`` gradient before adding it: one
weight's worth on top of the slice. For the usual head, an ``nn.Linear``, this
autograd function does the linear part of backward itself: each slice's
``dL/dlogits`` comes from autograd on the slice's own loss (so label smoothing,
``ignore_index`` and z-loss are torch's), then ``grad_hidden[slice] = g @ W``
into one buffer and ``grad_W += g^T @ h`` in place. The logits of one slice
live at a time.

Where a backward can follow (grad mode on), it does so in the forward: each
slice's logits are made once, so the chunked head runs what the plain step runs
and nothing twice (the plan prices it without recompute). Its backward then only
multiplies the gradients by the loss's upstream gradient (``1 / tokens`` for a
mean, a loss scale), in place: equal to the plain step up to the order of sums and
that one rounding. The gradients live from the head's forward on, the plain step
makes them at the head's backward: the loss's few ops apart. The inputs stay
saved, so a second backward through the graph (``retain_graph``) recomputes.

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


def _dtype(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def _slice_grad(
    loss: Any, rows: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
    labels: torch.Tensor, scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The slice's loss and ``d(scale * loss(logits)) / d logits`` for its ``rows``, by
    autograd on torch's own loss (the logits made here, so nothing else holds them);
    ``scale`` None: 1."""
    anchor = torch.zeros((), requires_grad=True)
    box: list[torch.Tensor] = []
    with torch.enable_grad():
        logits = _Tap.apply(anchor, F.linear(rows, w, b).detach(), box)
        part = loss.from_logits(logits, labels).float()
        del logits
    if scale is None:
        scale = torch.ones_like(part)
    torch.autograd.backward(part, scale, inputs=[anchor])
    return part.detach(), box[0]


def _gradients(
    x: torch.Tensor, weight: torch.Tensor, bias_dtype: torch.dtype | None, w: torch.Tensor,
    b: torch.Tensor | None, labels: torch.Tensor, chunks: int, loss: Any,
    scale: torch.Tensor | None, needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """Slice by slice: the gradients of ``scale`` x the summed loss with respect to the
    rows, the weight and the bias (None where not needed), and that summed loss."""
    needs_x, needs_w, needs_b = needs
    grad_x = torch.empty_like(x) if needs_x else None
    grad_w = grad_b = total = None
    for start, stop in token_slices(x.shape[0], chunks):
        part, g = _slice_grad(loss, x[start:stop], w, b, labels[start:stop], scale)
        total = part if total is None else total + part
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
            part_b = g.sum(0, dtype=bias_dtype)
            grad_b = part_b if grad_b is None else grad_b.add_(part_b)
        del g
    assert total is not None
    return grad_x, grad_w, grad_b, total


class _LinearCrossEntropy(torch.autograd.Function):
    """The summed loss; its gradients made in the forward (``early``) or in backward.

    Early, each slice's logits are made once: the forward runs what the plain step
    runs in its forward and its backward, and backward only scales the gradients by
    the loss's upstream gradient, in place. A second backward through the same graph
    (``retain_graph``) finds them handed on already and recomputes from the inputs.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        labels: torch.Tensor, chunks: int, loss: Any, early: bool,
    ) -> torch.Tensor:  # fmt: skip
        dtype = loss.autocast[1] if loss.autocast is not None else None
        x, w, b = _compute(hidden, weight, bias, dtype)
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunks, ctx.loss, ctx.dtype, ctx.early = chunks, loss, dtype, None
        needs = tuple(ctx.needs_input_grad[:3])
        if early and any(needs):
            # As backward would run it: the operands are cast already (``_compute``).
            with torch.autocast(hidden.device.type, enabled=False):
                *grads, total = _gradients(
                    x, weight, _dtype(bias), w, b, labels, chunks, loss, None, needs
                )
            ctx.early = grads
            return total
        total = None
        for start, stop in token_slices(hidden.shape[0], chunks):
            part = loss.from_logits(F.linear(x[start:stop], w, b), labels[start:stop]).float()
            total = part if total is None else total + part
        assert total is not None
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple:  # type: ignore[override]
        hidden, weight, bias, labels = ctx.saved_tensors
        if ctx.early is not None:
            grads, ctx.early = ctx.early, None  # handed on once: autograd may keep them
            grad_x, grad_w, grad_b = (
                None if g is None else g.mul_(grad_total) for g in grads
            )
        else:
            x, w, b = _compute(hidden, weight, bias, ctx.dtype)
            needs = tuple(ctx.needs_input_grad[:3])
            grad_x, grad_w, grad_b, _ = _gradients(
                x, weight, _dtype(bias), w, b, labels, ctx.chunks, ctx.loss, grad_total, needs
            )
        if grad_x is not None and grad_x.dtype != hidden.dtype:
            grad_x = grad_x.to(hidden.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def linear_cross_entropy_sum(
    rows: torch.Tensor, head: LinearHead, labels: torch.Tensor, chunks: int, loss: Any
) -> torch.Tensor:
    """The summed loss ``loss.from_logits`` gives over ``chunks`` slices, as float32.

    ``rows``: ``(N, H)``; ``labels``: ``(N,)``; ``loss``: the per-slice loss settings
    (:class:`~gradckpt.engine.chunking.cross_entropy._SliceLoss`).

    Example:
        >>> linear_cross_entropy_sum(h, LinearHead(lm_head.weight), y, 4, settings)
    """
    # Early gradients only where a backward can follow: under no_grad (an evaluation)
    # the forward computes the loss alone.
    early = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(rows, head.weight, head.bias, labels, chunks, loss, early)
