"""``make_loss(batch_size)`` for the common cases: a batch of tensors with a batch dimension.

:func:`gradckpt.tune` asks for a loss at each candidate micro-batch size. For
a model called with a dict (transformers: ``model(**batch)``) or a tuple of
tensors whose first dimension is the batch, :func:`sliced_loss` builds it:
micro-batch ``b`` is the first ``b`` rows, the rows repeated when the batch
given is smaller than ``b``.

Example:
    >>> make_loss = sliced_loss(model, {"input_ids": ids, "labels": ids})
    >>> make_loss(8)().backward()  # one forward and backward on 8 rows
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradckpt.api.model_calls import default_loss_from

__all__ = ["MakeLoss", "sliced_loss"]

LossFn = Callable[[], torch.Tensor]
MakeLoss = Callable[[int], LossFn]


def _rows(t: Any, b: int, dim: int) -> Any:
    if not isinstance(t, torch.Tensor) or t.dim() <= dim:
        return t
    n = t.shape[dim]
    if n >= b:
        return t.narrow(dim, 0, b)
    reps = -(-b // n)
    return torch.cat([t] * reps, dim=dim).narrow(dim, 0, b)


def sliced_loss(
    model: nn.Module,
    batch: Mapping[str, Any] | Sequence[Any],
    *,
    loss_from: Callable[[Any], torch.Tensor] | None = None,
    dim: int = 0,
) -> MakeLoss:
    """A ``make_loss(b)`` that runs ``model`` on ``b`` rows of ``batch``.

    Args:
        model: called as ``model(**rows)`` for a mapping, ``model(*rows)`` for a sequence.
        batch: tensors with the batch in dimension ``dim`` (other values pass unchanged).
        loss_from: the loss from the model's output (default: ``output.loss``, else the
            sum of its floating tensors).
        dim: the batch dimension.

    Example:
        >>> gradckpt.tune(model, sliced_loss(model, batch), "auto", global_batch=32)
    """
    if not isinstance(batch, (Mapping, Sequence)) or isinstance(batch, (str, bytes)):
        raise TypeError(
            f"sliced_loss takes a dict or a tuple of tensors with a batch dimension, got "
            f"{type(batch).__name__}; or write make_loss(batch_size) yourself"
        )
    to_loss = loss_from or default_loss_from

    def make_loss(b: int) -> LossFn:
        if isinstance(batch, Mapping):
            rows = {k: _rows(v, b, dim) for k, v in batch.items()}
            return lambda: to_loss(model(**rows))
        args = [_rows(v, b, dim) for v in batch]
        return lambda: to_loss(model(*args))

    return make_loss
