"""The model calls a step makes: recorded while ``loss_fn`` runs, remade at other shapes.

A :class:`Call` is one call of the model (its arguments and shape key); the
step at a new shape is ``loss_from(model(*args, **kwargs), *args, **kwargs)``
(:func:`step_at`, :func:`default_loss_from`); :func:`calls_for` turns
``shapes=`` into calls; :func:`length_of` says when a call differs from the
fitted one only in sequence length (then planned by rescaling).

Example:
    >>> recording = capture_call(model, loss_fn); recording()
    >>> calls = calls_for(step_call(recording.calls), [128, 256])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from gradckpt.planning.plans.call_key import Key, step_key
from gradckpt.planning.plans.planset import ShapeKey, as_written, shape_key

__all__ = [
    "Call",
    "LossFrom",
    "calls_for",
    "capture_call",
    "default_loss_from",
    "length_of",
    "step_at",
    "step_call",
]

LossFrom = Callable[..., torch.Tensor]  # (output, *args, **kwargs) -> scalar loss



@dataclass(frozen=True)
class Call:
    """One call of the model (its arguments and their shape key), or the first of a step's calls.

    A step that calls the model several times (a bi-encoder's anchors, then its
    positives) is one ``Call`` whose ``more`` holds the later calls and whose
    ``key`` is the step's :class:`~gradckpt.planning.plans.call_key.CallsKey`:
    it is planned as one step (:func:`step_call`).
    """

    args: tuple
    kwargs: dict[str, Any]
    key: Key
    #: The fitted call only: the whole-step profile and plan ``fit`` made from it
    #: (what the real re-plan route falls back on).
    profile: Any = field(default=None, compare=False, repr=False)
    plan: Any = field(default=None, compare=False, repr=False)
    #: The step's later calls of the model, in order.
    more: tuple[Call, ...] = field(default=(), compare=False, repr=False)

    @property
    def calls(self) -> tuple[Call, ...]:
        """Every call of the step, this one first."""
        return (self, *self.more)


def step_call(calls: list[Call] | tuple[Call, ...]) -> Call:
    """The step that made ``calls``, in order: the first, keyed by all of them.

    Example:
        >>> step_call([anchor, positive]).key.describe()
        '(8,16):int64 then (8,48):int64'
    """
    first, *rest = calls
    if not rest:
        return first
    key = step_key([c.key for c in calls])  # type: ignore[misc]
    return Call(first.args, first.kwargs, key, first.profile, first.plan, tuple(rest))


def default_loss_from(output: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``output.loss`` if it is a scalar tensor, else the sum of the output's floating tensors."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    leaves, _ = tree_flatten(output)
    parts = [t.sum() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not parts:
        raise TypeError(
            "gradckpt cannot make a loss from the model's output to plan a new shape; pass "
            "loss_from=lambda output, *args, **kwargs: <the loss> to gradckpt.fit"
        )
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def capture_call(model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> Callable[[], Any]:
    """A ``loss_fn`` that also records the model's calls (``.calls``, in order) in the first
    run that calls it with grad enabled.

    Calls made with grad disabled (an evaluation inside the step, a no-grad pass
    of the profiler) are not the step's: the shape guard does not see them either.
    """
    seen: list[Call] = []
    first: list[ShapeKey] = []  # the keys of the very first run's calls

    def recording() -> torch.Tensor:
        run: list[tuple[bool, Call]] = []

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # keyed as the guard keys a call: without the kwargs our own hooks add
            key = shape_key(args, as_written(module, kwargs))
            run.append((torch.is_grad_enabled(), Call(args, dict(kwargs), key)))

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            return loss_fn()
        finally:
            handle.remove()
            if not first:
                first.extend(c.key for _, c in run)
            if not seen and any(grad for grad, _ in run):  # the first run with grad calls
                # Keyed as in the first run: a model that writes its outputs into its input
                # dict (sentence-transformers) changed the batch the later runs see, not the
                # fresh batches training passes.
                same = len(first) == len(run)
                seen.extend(
                    replace(c, key=first[i]) if same else c
                    for i, (grad, c) in enumerate(run)
                    if grad
                )

    recording.calls = seen  # type: ignore[attr-defined]
    return recording


def step_at(model: nn.Module, call: Call, loss_from: LossFrom | None) -> Callable[[], torch.Tensor]:
    """The zero-argument step at ``call``'s shape: each of its model calls, the sum of their losses."""
    make_loss = loss_from or default_loss_from

    def loss_fn() -> torch.Tensor:
        losses = [make_loss(model(*c.args, **c.kwargs), *c.args, **c.kwargs) for c in call.calls]
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()

    return loss_fn


def _resized(x: Any, length: int, at: int, dim: int) -> Any:
    """``x`` with dimension ``dim`` set to ``length`` (content tiled) if it has size ``at`` there."""
    if not isinstance(x, torch.Tensor) or x.dim() <= dim or x.shape[dim] != at:
        return x
    reps = -(-length // at)
    tiled = torch.cat([x] * reps, dim=dim) if reps > 1 else x
    return tiled.narrow(dim, 0, length).clone()


def calls_for(fitted: Call, shapes: Sequence[Any], seq_dim: int = 1) -> list[Call]:
    """The model calls ``shapes`` stand for.

    Each item is a dict (keyword arguments), a tuple or list (positional
    arguments), a tensor (the one positional argument), or an int: a sequence
    length, meaning the fitted call's inputs with dimension ``seq_dim`` of every
    tensor whose size there equals the fitted length set to that length (token
    ids are tiled, so they stay valid). For a step that calls the model several
    times, each item is a list with one such entry per call, in call order.
    """
    if not fitted.more:
        return [_one_call(fitted, item, seq_dim) for item in shapes]
    n = len(fitted.calls)
    steps = []
    for item in shapes:
        if not isinstance(item, list) or len(item) != n:
            raise TypeError(
                f"the fitted step calls the model {n} times ({fitted.key.describe()}): each "
                f"item of shapes= is a list of {n} entries, one per call (a sequence length, "
                f"keyword inputs, positional inputs or a tensor); got {item!r:.80}"
            )
        steps.append(step_call([_one_call(c, x, seq_dim) for c, x in zip(fitted.calls, item)]))
    return steps


def _one_call(fitted: Call, item: Any, seq_dim: int) -> Call:
    """The one model call ``item`` stands for, beside the fitted call."""
    if isinstance(item, bool):
        raise TypeError(f"shapes= holds example inputs or sequence lengths, not {item!r}")
    if isinstance(item, int):
        at = _fitted_length(fitted, seq_dim)
        if item <= 0:
            raise ValueError(f"a sequence length in shapes= must be positive, got {item}")
        args = tuple(_resized(a, item, at, seq_dim) for a in fitted.args)
        kwargs = {k: _resized(v, item, at, seq_dim) for k, v in fitted.kwargs.items()}
    elif isinstance(item, dict):
        args, kwargs = (), dict(item)
    elif isinstance(item, (tuple, list)):
        args, kwargs = tuple(item), {}
    elif isinstance(item, torch.Tensor):
        args, kwargs = (item,), {}
    else:
        raise TypeError(
            "each item of shapes= is a sequence length (int), keyword inputs (dict), "
            f"positional inputs (tuple) or one input tensor; got {type(item).__name__}"
        )
    return Call(args, kwargs, shape_key(args, kwargs))


def _fitted_length(fitted: Call, seq_dim: int) -> int:
    leaves, _ = tree_flatten((fitted.args, fitted.kwargs))
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.dim() > seq_dim:
            return int(x.shape[seq_dim])
    raise ValueError(
        f"shapes= gave sequence lengths, but the model's call has no tensor input with a "
        f"dimension {seq_dim}; give example inputs (dicts or tuples) instead"
    )


def length_of(fitted: Key, key: Key, seq_dim: int) -> tuple[int, int] | None:
    """``(fitted length, new length)`` if ``key`` is ``fitted`` with only the sequence length changed.

    The sequence length is dimension ``seq_dim`` of the first tensor input that has
    one; every tensor whose size there is that length may change it (to the same
    new length), and nothing else may change. Steps of several calls are not rescaled (None).
    """
    if not isinstance(fitted, ShapeKey) or not isinstance(key, ShapeKey):
        return None
    if len(fitted.args) != len(key.args) or [k for k, _ in fitted.kwargs] != [
        k for k, _ in key.kwargs
    ]:
        return None
    pairs = list(
        zip(
            [*fitted.args, *(s for _, s in fitted.kwargs)], [*key.args, *(s for _, s in key.kwargs)]
        )
    )
    at = next(
        (a.shape[seq_dim] for a, _ in pairs if a is not None and len(a.shape) > seq_dim), None
    )
    if at is None:
        return None
    new = None
    for a, b in pairs:
        if (a is None) != (b is None):
            return None
        if a is None or b is None:
            continue
        if (a.dtype, a.grad, len(a.shape)) != (b.dtype, b.grad, len(b.shape)):
            return None
        for d, (x, y) in enumerate(zip(a.shape, b.shape)):
            if x == y:
                continue
            if d != seq_dim or x != at or (new is not None and y != new):
                return None
            new = y
    return (at, new) if new is not None else None
