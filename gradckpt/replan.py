"""Planning at other shapes than the one ``loss_fn`` runs: what ``fit``/``plan`` do with
``shapes=`` and what the shape guard calls on a new shape.

``loss_fn`` is a zero-argument step at one fixed batch, so it cannot be rerun at
another shape. What can be: the model call itself. At a new shape gradckpt
profiles the step ``loss_from(model(*args, **kwargs), *args, **kwargs)`` under
fake tensors (nothing is allocated, so a shape too big to run plainly can still
be planned) with the call's own arguments, and solves it under the same budget.

The assumption, stated: the step's memory is the model call's plus the loss
``loss_from`` computes from its output. The default ``loss_from`` takes
``output.loss`` when the output carries a scalar loss (transformers models
called with ``labels``: exactly the training step) and otherwise sums the
output's floating tensors; pass ``loss_from`` when your loss outside the model
keeps more (e.g. ``lambda out, x: F.cross_entropy(out, torch.zeros(len(out),
dtype=torch.long))``: label values do not change memory, only shapes do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from gradckpt.planning.planset import ShapeKey, shape_key
from gradckpt.planning.simulate import simulate

__all__ = ["Call", "LossFrom", "calls_for", "capture_call", "default_loss_from", "step_at"]

LossFrom = Callable[..., torch.Tensor]  # (output, *args, **kwargs) -> scalar loss


@dataclass(frozen=True)
class Call:
    """One call of the model: its arguments and their shape key."""

    args: tuple
    kwargs: dict[str, Any]
    key: ShapeKey


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
    """A ``loss_fn`` that also records the model's first top-level call (see :func:`recorded`)."""
    seen: list[Call] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not seen:
            seen.append(Call(args, dict(kwargs), shape_key(args, kwargs)))

    def recording() -> torch.Tensor:
        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            return loss_fn()
        finally:
            handle.remove()

    recording.calls = seen  # type: ignore[attr-defined]
    return recording


def step_at(model: nn.Module, call: Call, loss_from: LossFrom | None) -> Callable[[], torch.Tensor]:
    """The zero-argument step at ``call``'s shape: the model call and its loss."""
    make_loss = loss_from or default_loss_from

    def loss_fn() -> torch.Tensor:
        return make_loss(model(*call.args, **call.kwargs), *call.args, **call.kwargs)

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
    ids are tiled, so they stay valid).
    """
    calls = []
    for item in shapes:
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
        calls.append(Call(args, kwargs, shape_key(args, kwargs)))
    return calls


def _fitted_length(fitted: Call, seq_dim: int) -> int:
    leaves, _ = tree_flatten((fitted.args, fitted.kwargs))
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.dim() > seq_dim:
            return int(x.shape[seq_dim])
    raise ValueError(
        f"shapes= gave sequence lengths, but the model's call has no tensor input with a "
        f"dimension {seq_dim}; give example inputs (dicts or tuples) instead"
    )


def predicted_peak(profile_at: Callable[[Call], Any], plan: Any, call: Call) -> int:
    """``plan``'s simulated peak at ``call``'s shape."""
    return simulate(profile_at(call), plan).peak_bytes


def length_of(fitted: ShapeKey, key: ShapeKey, seq_dim: int) -> tuple[int, int] | None:
    """``(fitted length, new length)`` if ``key`` is ``fitted`` with only the sequence length changed.

    The sequence length is dimension ``seq_dim`` of the first tensor input that has
    one; every tensor whose size there is that length may change it (to the same
    new length), and nothing else may change.
    """
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


class ShapePlanner:
    """Plans a model call at its shape: rescaled from profiles when exact, else fake-profiled.

    A call that differs from the fitted one only in sequence length is planned
    from a :class:`~gradckpt.planning.rescale.LengthScaling` built (once, at the first
    such call) from fake profiles at four lengths; any other call, or a model the
    scaling refuses, is profiled under fake tensors at its own shape.
    """

    def __init__(
        self,
        model: nn.Module,
        fitted: Call,
        loss_from: LossFrom | None,
        profile_fake: Callable[[Callable[[], torch.Tensor]], Any],
        solve_profile: Callable[[Any], Any],
        seq_dim: int = 1,
        rescale: bool = True,
    ) -> None:
        self.model, self.fitted, self.loss_from = model, fitted, loss_from
        self.profile_fake, self.solve_profile, self.seq_dim = profile_fake, solve_profile, seq_dim
        self.rescale = rescale
        self.scaling: Any = None
        self.scaling_tried = False
        self.rescaled = 0  # plans made from the scaling (no profile at their shape)

    def profile_call(self, call: Call) -> Any:
        return self.profile_fake(step_at(self.model, call, self.loss_from))

    def __call__(self, call: Call) -> Any:
        lengths = length_of(self.fitted.key, call.key, self.seq_dim) if self.rescale else None
        if lengths is None:
            return self.solve_profile(self.profile_call(call))
        if self.scaling is not None:
            prof = self.scaling.at(lengths[1])
            if prof is not None:
                self.rescaled += 1
                return self.solve_profile(prof)
        prof = self.profile_call(call)
        if not self.scaling_tried:
            self.scaling_tried = True
            self.scaling = self._fit_scaling(lengths, prof)
        return self.solve_profile(prof)

    def _fit_scaling(self, lengths: tuple[int, int], at_new: Any) -> Any:
        from gradckpt.planning.rescale import fit_length_scaling

        fitted, new = lengths
        low, high = sorted((fitted, new))
        candidates = [fitted, (low + high) // 2, low // 2, (3 * low) // 4, low + (high - low) // 4]
        others: list[int] = []
        for n in candidates:
            if n >= 1 and n != new and n not in others:
                others.append(n)
        profiles = {new: at_new}
        try:
            for n in others[:3]:
                [call] = calls_for(self.fitted, [n], self.seq_dim)
                profiles[n] = self.profile_call(call)
        except Exception:
            # A model that cannot run at one of these lengths: plan every shape by profiling it.
            return None
        return fit_length_scaling(profiles)
