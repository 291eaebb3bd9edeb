"""The verbs' arguments, refused in the user's terms before anything is profiled.

Same layer as :mod:`gradckpt.api`, whose ``profile``, ``plan``, ``fit``,
``frontier`` and ``explain`` call :func:`check_arguments` first.

Example:
    >>> check_arguments(model, loss_fn, "3GiB", blocks=["layers.0"])
"""

from __future__ import annotations

import numbers
from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from gradckpt.api.options import ProfileOptions, ShapeOptions, StepOptions
from gradckpt.planning.plans.offload_options import OffloadOptions, offload_options
from gradckpt.planning.solving.budget import Budget
from gradckpt.planning.solving.solvers import SOLVERS
from gradckpt.profiling.records import Profile

__all__ = ["check_arguments", "check_groups", "check_shapes", "offload_for"]

_UNSET: Any = object()


def check_arguments(
    model: object,
    loss_fn: object,
    budget: object = _UNSET,
    *,
    blocks: object = None,
    solver: object = "dp",
    repeats: object = 3,
    profile: object = None,
    segments: object = True,
    shapes: object = None,
    loss_from: object = None,
) -> Budget | None:
    """Refuse bad arguments in the user's terms, before anything is profiled; the budget
    read (None when not given), the one time it is parsed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(
            "loss_fn must be a zero-argument callable that runs one forward and returns the "
            f"loss (e.g. lambda: model(**batch).loss), got {type(loss_fn).__name__}"
        )
    read = Budget.read(budget) if budget is not _UNSET else None
    if blocks is not None and not callable(blocks):
        listed = isinstance(blocks, Collection) and not isinstance(blocks, str)
        if not listed or not all(isinstance(p, str) for p in blocks):
            raise TypeError(
                "blocks= takes a list of module paths (e.g. ['layers.0', 'layers.1'], from "
                f"model.named_modules()) or a predicate (path, module) -> bool; got {blocks!r}"
            )
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral):
        raise TypeError(f"repeats= is a whole number of profiled steps (e.g. 3), got {repeats!r}")
    if repeats < 1:
        raise ValueError(f"repeats= must be at least 1 (profiled steps), got {repeats}")
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(
            "profile= takes a Profile made by gradckpt.profile(model, loss_fn), got "
            f"{type(profile).__name__}"
        )
    if isinstance(solver, str):
        if solver not in SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    elif not callable(solver):
        raise TypeError(f"solver= is a name from {sorted(SOLVERS)} or a callable, got {solver!r}")
    if not isinstance(segments, bool):
        raise TypeError(f"segments= is True or False, got {segments!r}")
    if shapes is not None:
        check_shapes(shapes)
    if loss_from is not None and not callable(loss_from):
        raise TypeError(
            "loss_from= takes a callable (output, *args, **kwargs) -> scalar loss, got "
            f"{type(loss_from).__name__}"
        )
    return read


def check_shapes(shapes: object) -> None:
    """``shapes=`` holds sequence lengths or example inputs; refuse anything else now.

    An item that holds no tensor (``{"idx": 3}``, ``(1, 2)``) would be planned as a
    call with those plain values and never match a real call.

    Example:
        >>> check_shapes([128, 256, {"input_ids": torch.zeros(4, 512, dtype=torch.long)}])
    """
    if isinstance(shapes, (str, bytes, torch.Tensor)) or not isinstance(shapes, Collection):
        raise TypeError(
            "shapes= is a list of sequence lengths or example inputs (e.g. [128, 512]), got "
            f"{type(shapes).__name__}"
        )
    for item in shapes:
        _check_shape_item(item, in_step=False)


def _check_shape_item(item: object, in_step: bool) -> None:
    if isinstance(item, bool) or (isinstance(item, int) and item <= 0):
        raise ValueError(f"a sequence length in shapes= is a positive int, got {item!r}")
    if isinstance(item, (int, torch.Tensor)):
        return
    if isinstance(item, list) and not in_step and not _has_tensor(item):
        for entry in item:  # one entry per model call of the step
            _check_shape_item(entry, in_step=True)
        return
    if isinstance(item, (dict, tuple, list)):
        if not _has_tensor(item):
            raise ValueError(
                f"shapes= item {item!r:.60} holds no tensor: give a sequence length (an int) "
                "or example inputs with tensors of the shape to plan (a dict of keyword "
                "inputs, a tuple of positional inputs, or one tensor)"
            )
        return
    raise TypeError(
        "each item of shapes= is a sequence length (int), keyword inputs (dict), positional "
        f"inputs (tuple) or one input tensor; got {type(item).__name__}"
    )


def _has_tensor(value: object) -> bool:
    leaves, _ = tree_flatten(value)
    return any(isinstance(x, torch.Tensor) for x in leaves)


def offload_for(offload: object, solver: object) -> OffloadOptions | None:
    """``offload=`` checked and as options (None: off)."""
    options = offload_options(offload)
    if options is not None and solver != "dp":
        raise ValueError(
            f"offload= works with solver='dp' (the baselines only recompute); got solver={solver!r}"
        )
    return options


def check_groups(
    shapes: object, profiling: object, step: object
) -> tuple[ShapeOptions, ProfileOptions, StepOptions]:
    """``shapes=``, ``profiling=`` and ``step=`` as their option values (None: the defaults).

    Example:
        >>> shapes, profiling, step = check_groups(None, ProfileOptions(repeats=1), None)
    """
    found = []
    for name, value, kind in (
        ("shapes", shapes, ShapeOptions), ("profiling", profiling, ProfileOptions),
        ("step", step, StepOptions),
    ):  # fmt: skip
        if value is not None and not isinstance(value, kind):
            raise TypeError(
                f"{name}= takes a gradckpt.{kind.__name__}(...), got {type(value).__name__}"
            )
        found.append(value if value is not None else kind())
    return found[0], found[1], found[2]

