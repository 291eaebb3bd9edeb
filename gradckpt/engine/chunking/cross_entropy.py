"""The head and the loss in slices: cross-entropy whose logits are never whole.

``chunked_cross_entropy(hidden, head, labels, chunks=k)`` is
``F.cross_entropy(head(hidden).float().view(-1, V), labels.view(-1))`` computed
``k`` slices of tokens at a time (the pattern of torchtune's chunked output loss
and of Mini-Sequence Transformer's head, here on gradckpt's own recompute
engine): each slice's logits, their upcast and log-softmax live only while that
slice runs, in the forward and again in its backward. The loss is the exact sum
of the slice sums over the exact number of counted tokens; what changes is only
the order of floating-point additions (the loss, and the head's weight gradient,
accumulated slice by slice).

Example:
    >>> loss = chunked_cross_entropy(h, model.lm_head, labels, chunks=8)
    >>> loss.backward()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gradckpt.engine.chunking.linear_loss import LinearHead, linear_cross_entropy_sum
from gradckpt.engine.chunking.slices import chunked_cat, chunked_sum

__all__ = ["REDUCTIONS", "chunked_cross_entropy", "slice_loss"]

REDUCTIONS = ("mean", "sum", "none")


class _SliceLoss:
    """The loss of one slice of tokens: head, upcast, cross-entropy (a sum, or per token).

    An object (not a closure) so its settings read in error messages and reprs;
    the engine reruns it in the slice's recompute with the same arguments.
    """

    def __init__(
        self, head: Callable[[torch.Tensor], torch.Tensor], *, upcast: torch.dtype | None,
        ignore_index: int, label_smoothing: float, z_loss: float, per_token: bool,
        autocast: tuple[str, torch.dtype] | None = None,
    ) -> None:  # fmt: skip
        self.head = head
        self.upcast = upcast
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.per_token = per_token
        self.autocast = autocast  # (device type, dtype) the head ran under where it was called

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.autocast is not None:
            with torch.autocast(self.autocast[0], dtype=self.autocast[1]):
                return self.head(hidden)
        return self.head(hidden)

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.from_logits(self.logits(hidden), labels)

    def from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The slice's loss from its logits as the head returned them (upcast here)."""
        if self.upcast is not None:
            logits = logits.to(self.upcast)
        loss = F.cross_entropy(
            logits, labels, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, reduction="none" if self.per_token else "sum",
        )  # fmt: skip
        if self.z_loss:
            # PaLM's z-loss: coefficient x log(Z)^2 per counted token, in the loss's dtype.
            z = torch.logsumexp(logits, dim=-1).pow(2) * (labels != self.ignore_index)
            loss = loss + self.z_loss * (z if self.per_token else z.sum())
        return loss


def _loss_dtype(
    head: LinearHead, rows: torch.Tensor, upcast: torch.dtype | None,
    autocast: tuple[str, torch.dtype] | None,
) -> torch.dtype:  # fmt: skip
    """The dtype ``F.cross_entropy`` would return on the head's (upcast) logits."""
    if upcast is not None:
        return upcast
    if autocast is not None:
        return autocast[1]
    return torch.result_type(rows, head.weight)


def slice_loss(head: Callable[[torch.Tensor], torch.Tensor], **settings: Any) -> _SliceLoss:
    """The per-slice loss :func:`chunked_cross_entropy` runs (for the lazy logits route)."""
    return _SliceLoss(head, **settings)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    *,
    chunks: int,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    upcast: torch.dtype | None = torch.float32,
    z_loss: float = 0.0,
    autocast: tuple[str, torch.dtype] | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``head(hidden)`` against ``labels``, ``chunks`` slices of tokens at a time.

    Args:
        hidden: ``(..., H)`` states, one row per token (the leading dimensions are
            flattened: ``labels`` must have the same leading shape).
        head: maps ``(n, H)`` to ``(n, V)`` logits row by row (an ``nn.Linear`` LM head);
            a :class:`LinearHead` (its weight and bias) has its backward done in
            place, without a second weight gradient per slice.
        labels: class index per token; ``ignore_index`` tokens do not count.
        chunks: number of slices (near-equal; need not divide the token count).
        label_smoothing, ignore_index: as in ``F.cross_entropy``.
        reduction: "mean" (over counted tokens), "sum", or "none" (one loss per token).
        upcast: dtype the logits are cast to before the loss (None: as the head returns).
        z_loss: coefficient of PaLM's auxiliary ``log(Z)^2`` term (0: none), per
            counted token, reduced like the loss.
        autocast: ``(device type, dtype)`` to run the head under (None: as called).

    Returns:
        The loss: what ``F.cross_entropy`` on the whole logits returns, up to the
        order of floating-point sums.

    Example:
        >>> loss = chunked_cross_entropy(h, lm_head, y, chunks=4, label_smoothing=0.1)
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"chunked_cross_entropy: hidden {tuple(hidden.shape)} has one row per token, so "
            f"labels must have shape {tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}"
        )
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat = labels.reshape(-1)
    fn = _SliceLoss(
        head, upcast=upcast, ignore_index=ignore_index, label_smoothing=label_smoothing,
        z_loss=z_loss, per_token=reduction == "none", autocast=autocast,
    )  # fmt: skip
    if reduction == "none":
        return chunked_cat(fn, chunks, rows, flat, name="chunked_cross_entropy").view(labels.shape)
    if isinstance(head, LinearHead):  # its backward done here: no second weight gradient
        total = linear_cross_entropy_sum(rows, head, flat, chunks, fn)
        total = total.to(_loss_dtype(head, rows, upcast, autocast))
    else:
        total = chunked_sum(fn, chunks, rows, flat, name="chunked_cross_entropy")
    if reduction == "sum":
        return total
    return total / (flat != ignore_index).sum()
