"""A shape guard travels with copies of its model: ``copy.deepcopy``, pickle, ``torch.save``.

The guard lives in the model's ``__dict__``, so every copy of the model gets a
copy of it, made here. An in-process deep copy keeps everything, the planner
too: it plans the original's structure, which is the copy's (it profiles the
original under fake tensors, never the copy). A pickled copy keeps what is
plain data (plans, active shape, policy, counters); closures do not travel, so
a ``"replan"`` guard becomes a ``"warn"`` one and its warnings say why. Either
copy is bound to its model (plan switches install on the copy) by
:meth:`~gradckpt.apply.guard_routing.ShapeGuard.bind`: at once for a deep copy, at the
first call for a pickled one.

Example:
    >>> twin = copy.deepcopy(fitted_model)
    >>> gradckpt.shape_stats(twin).policy
    'replan'
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from gradckpt.apply.guard_routing import ShapeGuard

__all__ = ["NO_PLANNER", "copied", "deepcopied", "reduced", "unpickled"]

NO_PLANNER = (
    " This model is a pickled or torch.save'd copy of a fitted model: it kept the plans, "
    "policy and budget but not the planner; gradckpt.fit the copy to re-plan new shapes."
)

# Bound to one model or one process: never copied into another model's guard.
_LOCAL_FIELDS = ("switch", "owner", "recompiles", "_busy", "_steps")


def copied(guard: ShapeGuard, keep_planner: bool) -> ShapeGuard:
    """``guard`` for a copy of its model, not yet bound to it.

    Without the planner (``keep_planner=False``), every callable field is back
    to its default and ``"replan"`` becomes ``"warn"``. The copy is of the same
    class (a subclass's fields travel too).
    """
    changes: dict[str, Any] = {"switch": None, "owner": None, "recompiles": None,
                               "_busy": threading.local(), "_steps": threading.local()}  # fmt: skip
    for f in dataclasses.fields(guard):
        value = getattr(guard, f.name)
        if f.name in _LOCAL_FIELDS:
            continue
        if callable(value) and not keep_planner:
            changes[f.name] = _default(f)
        elif isinstance(value, (dict, list, set)):
            changes[f.name] = type(value)(value)  # the copy's counters and caches are its own
    if guard.policy == "replan" and not keep_planner:
        changes.update(policy="warn", note=guard.note + NO_PLANNER)
    return dataclasses.replace(guard, **changes)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def deepcopied(guard: ShapeGuard, memo: dict[int, Any]) -> ShapeGuard:
    """``copy.deepcopy`` of ``guard``: bound to the copy of its model when that is being made."""
    twin = copied(guard, keep_planner=True)
    owner = guard.owner() if guard.owner is not None else None
    model = memo.get(id(owner)) if owner is not None else None
    if isinstance(model, nn.Module):  # deepcopy registers the model's copy before its __dict__
        twin.bind(model)
    return twin


def reduced(guard: ShapeGuard) -> tuple[Any, ...]:
    """``guard.__reduce__``: what pickle, ``torch.save`` and ``copy.copy`` keep (plain data)."""
    twin = copied(guard, keep_planner=False)
    state = {f.name: getattr(twin, f.name) for f in dataclasses.fields(twin)}
    for name in _LOCAL_FIELDS:
        state.pop(name)
    return (unpickled, (type(twin), state))


def unpickled(cls: type[ShapeGuard], state: dict[str, Any]) -> ShapeGuard:
    """A guard from :func:`reduced`'s state (bound to its model at the model's first call)."""
    return cls(switch=None, **state)
