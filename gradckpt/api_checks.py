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

from torch import nn

from gradckpt.planning.solving.budget import check_budget
from gradckpt.planning.solving.solvers import SOLVERS
from gradckpt.profiling.records import Profile

__all__ = ["check_arguments"]

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
) -> None:
    """Refuse bad arguments in the user's terms, before anything is profiled."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(
            "loss_fn must be a zero-argument callable that runs one forward and returns the "
            f"loss (e.g. lambda: model(**batch).loss), got {type(loss_fn).__name__}"
        )
    if budget is not _UNSET:
        check_budget(budget)
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
