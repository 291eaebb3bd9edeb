"""The shape guard on a model: every call of a guarded model is checked against its plan's shape.

A plan's predicted peak holds for the shape it was made at. The guard
(:class:`~gradckpt.apply.guard_routing.ShapeGuard`: the plans by shape, and where
each call goes: switch, plan, warn or refuse) runs at the top of the model's
root wrapper, before any op of the call (:func:`check`). This module is where it
lives: installed on the model, found at each call, paused while gradckpt
profiles the model, and asked for its stats; the guard's names are importable
from here too.

Every path that runs a plan has a guard: ``fit``'s (re-plans new shapes), a plan
set's, and ``apply(model, plan)``'s, which warns (a plan alone records its units' input
shapes, not the model call's key: the guard learns the key from the first call
whose units all get the shapes they were planned for, and warns once for any
other key). The guard lives on the model (in its ``__dict__``), so copies carry
it: a ``copy.deepcopy`` keeps it whole (re-planning through the original's
planner, which plans the same structure), a pickled or ``torch.save``'d copy
keeps its plans, policy and budget but cannot plan, so ``"replan"`` becomes
``"warn"`` there (:mod:`gradckpt.apply.guard_copies`). An argument the key
cannot read is named in one warning.

Example:
    >>> install(model, ShapeGuard("warn", {None: plan}, None, None))
    >>> print(shape_stats(model).summary())
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from gradckpt.apply.guard_learning import Learning, finish, learning
from gradckpt.apply.guard_routing import (
    POLICIES,
    Planner,
    Predictor,
    ShapeError,
    ShapeGuard,
    ShapeStats,
    quick_sig,
    register_installer,
)
from gradckpt.planning.plans.call_key import as_written
from gradckpt.profiling.adapters import Adapter, register_adapter

__all__ = [
    "POLICIES",
    "Learning",
    "Planner",
    "Predictor",
    "ShapeError",
    "ShapeGuard",
    "ShapeStats",
    "check",
    "finish",
    "forget",
    "guard_of",
    "guards",
    "install",
    "learning",
    "paused",
    "quick_sig",
    "raised",
    "register_installer",
    "returned",
    "shape_stats",
]

# The attribute of the model's __dict__ that holds its guard (copied and pickled with it).
_ATTR = "_gradckpt_shape_guard"


def install(model: nn.Module, guard: ShapeGuard) -> None:
    """Guard ``model``'s calls with ``guard`` (apply then installs the root wrapper, which checks).

    The guard is kept in the model's ``__dict__``: copies of the model carry it.
    """
    guard.bind(model)
    model.__dict__[_ATTR] = guard


def forget(model: nn.Module) -> None:
    """Stop guarding ``model`` (``remove``)."""
    model.__dict__.pop(_ATTR, None)


def guard_of(model: nn.Module) -> ShapeGuard | None:
    """The shape guard of ``model`` (a copy's is bound to the copy here), or None."""
    guard = model.__dict__.get(_ATTR) if isinstance(model, nn.Module) else None
    if not isinstance(guard, ShapeGuard):
        return None
    owner = guard.owner() if guard.owner is not None else None
    if owner is not model:
        if owner is not None:  # another model's guard (its __dict__ copied by hand): a copy
            guard = guard.copied(keep_planner=True)
            model.__dict__[_ATTR] = guard
        guard.bind(model)
    return guard


@contextlib.contextmanager
def paused(model: nn.Module) -> Iterator[None]:
    """No shape checks of ``model``'s calls while inside (gradckpt profiling it).

    A profile runs the model's step itself; a switch or re-plan then would swap
    the wrappers the profiler installed in the middle of its pass.
    """
    guard = guard_of(model)
    if guard is None:
        yield
        return
    before = getattr(guard._busy, "on", False)
    guard._busy.on = True
    try:
        yield
    finally:
        guard._busy.on = before


# gradckpt's own profiling passes (every one goes through gradckpt.profile) run
# with the model's shape guard paused: registered here, the profiler never imports apply.
register_adapter(
    Adapter("shape guard", recognizes=lambda model: guard_of(model) is not None, prepare=paused)
)


def guards(model: nn.Module) -> bool:
    """Whether ``model`` has a shape guard (apply then installs the root wrapper)."""
    return guard_of(model) is not None


def check(forward: Any, args: tuple, kwargs: dict) -> Callable[..., Any] | Learning | None:
    """Run the shape guard of the model ``forward`` is bound to (the root wrapper's hook).

    Returns the model's new root wrapper when the guard switched plans (the
    calling wrapper is then stale: the rest of the call must run through the new
    one, whose units' segments open only inside their own root); a
    :class:`Learning` record when the plan's units check this call (the root
    passes it to :func:`finish` when the call ends); else None. Looked up by the
    model at each call, so a copy of the model (its forward bound to the copy)
    runs under its own copy of the guard.
    """
    model = getattr(forward, "__self__", None)
    if not isinstance(model, nn.Module) or _ATTR not in model.__dict__:
        return None
    guard = guard_of(model)
    if guard is None:
        return None
    switches = guard.switches
    entry = guard.on_call(args, as_written(model, kwargs))
    if entry is not None:
        return entry
    if guard.switches == switches:
        return None
    guard._busy.redispatched = True  # the new root's check of this same call is a no-op
    return model.__dict__.get("forward")


def returned(forward: Any, out: Any) -> None:
    """The root wrapper's call of ``forward`` returned ``out``: the guard follows its step."""
    model = getattr(forward, "__self__", None)
    if isinstance(model, nn.Module) and _ATTR in model.__dict__:
        guard = guard_of(model)
        if guard is not None:
            guard.on_return(out)


def raised(forward: Any) -> None:
    """The root wrapper's call of ``forward`` raised: the guard's step ends there."""
    model = getattr(forward, "__self__", None)
    if isinstance(model, nn.Module) and _ATTR in model.__dict__:
        guard = guard_of(model)
        if guard is not None:
            guard.abandon()


def shape_stats(model: nn.Module) -> ShapeStats | None:
    """What the shape guard of ``model`` did: plans, re-plans and their time, switches.

    Example:
        >>> gradckpt.fit(model, loss_fn, "500MiB")
        >>> ...  # train on varying lengths
        >>> print(gradckpt.shape_stats(model).summary())
    """
    guard = guard_of(model)
    return guard.stats() if guard is not None else None
