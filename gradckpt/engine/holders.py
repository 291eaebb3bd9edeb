"""Saved-tensor holders, their unpack hook, and the stack of running regions.

While a region runs its forward, autograd stores a :class:`Holder` in place of
each tensor it saves. The first unpack in a backward pass asks the holder's
region to recompute (once per pass, keyed by the graph task id); values are
handed out once and then forgotten, so recomputed tensors die as soon as
backward has used them. A holder may instead hold a :class:`Deferred`: its
value will come from a nested region's own recompute. A backward pass started
*inside* a recompute (``autograd.grad`` in checkpointed code, double backward)
that reaches such a holder gets its value from that nested region too, never
by recomputing the running region again (that would rerun the same
``autograd.grad``, without end). Under ``torch.utils.checkpoint.GraphExecGroup``
all backward calls of the group are one pass.

The stack of running regions is thread-local, as autograd's hooks are: it says
whether code runs inside a region's forward (nested regions are no-ops there)
or inside a recompute (nested regions become real).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import CheckpointError as _TorchCheckpointError

if TYPE_CHECKING:
    from gradckpt.engine.frame import Frame

__all__ = [
    "DEBUG_TIP",
    "CheckpointError",
    "Deferred",
    "Holder",
    "PassId",
    "active_frame",
    "current_exec_group",
    "graph_id",
    "in_region_forward",
    "is_group_id",
    "meta",
    "region_stack",
    "running_gid",
    "unpack",
]


class CheckpointError(_TorchCheckpointError):
    """The recompute of a region did not reproduce what its forward saved.

    A subclass of ``torch.utils.checkpoint.CheckpointError`` (itself a
    ``RuntimeError``), so code that catches torch's error catches ours.
    """


DEBUG_TIP = (
    "The region must run the same ops on the same shapes in its recompute as in its "
    "forward (no data-dependent control flow on changed state). Pass debug=True to "
    "gradckpt.checkpoint (or wrap the call in "
    "torch.utils.checkpoint.set_checkpoint_debug_enabled(True)) to see both op sequences."
)


class Holder:
    """Stands in for one saved tensor in the autograd graph; filled per backward pass."""

    __slots__ = ("__weakref__", "meta", "owner", "values")

    def __init__(self, owner: Frame, meta: Any) -> None:
        self.owner = owner  # keeps the region (its inputs) alive while the graph needs it
        self.meta = meta
        self.values: dict[int, Any] = {}


class Deferred:
    """A holder's value for this backward pass will come from ``frame``'s recompute."""

    __slots__ = ("frame",)

    def __init__(self, frame: Frame) -> None:
        self.frame = frame


#: Identifies one backward pass: autograd's graph task id, or ``("group", n)`` for
#: all backward calls under one ``GraphExecGroup``.
PassId = int | tuple[str, int]

_CONSUMED = object()
_MISSING = object()
_LOCAL = threading.local()
_fresh_ids = itertools.count(start=1 << 62)


def region_stack() -> list[tuple[Frame, PassId | None]]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def active_frame() -> tuple[Frame, PassId | None] | None:
    """The innermost running region and its backward id (None during its forward)."""
    stack = region_stack()
    return stack[-1] if stack else None


def in_region_forward() -> bool:
    """True while a region runs its forward: regions opened there are no-ops."""
    top = active_frame()
    return top is not None and top[1] is None


current_exec_group = getattr(torch._C, "_get_graph_exec_group", lambda: None)
_GROUP_IDS: weakref.WeakKeyDictionary[Any, PassId] = weakref.WeakKeyDictionary()


def graph_id() -> PassId:
    """The id of the backward pass that unpacks now: regions recompute once per id.

    Inside ``torch.utils.checkpoint.GraphExecGroup`` all backward calls share
    one id (the group's), so a backward split into several ``autograd.grad``
    calls recomputes each region once, as torch's checkpoint does. A backward
    started inside a recompute (``autograd.grad`` in checkpointed code) is a
    pass of its own even then: it belongs to the region's code, not to the
    caller's group, and must not consume what the group's backward still needs.
    """
    group = current_exec_group()
    if group is not None and not _recompute_running():
        return group_id(group)
    gid = torch._C._current_graph_task_id()
    # Unpacking outside backward (e.g. reading grad_fn._saved_*) gets a fresh
    # id, so it recomputes rather than reading a stale pass.
    return next(_fresh_ids) if gid == -1 else gid


def _recompute_running() -> bool:
    return any(gid is not None for _, gid in region_stack())


def group_id(group: Any) -> PassId:
    # A key that does not keep the group alive (holders keep their keys).
    found = _GROUP_IDS.get(group)
    if found is None:
        found = _GROUP_IDS[group] = ("group", next(_fresh_ids))
    return found


def is_group_id(gid: PassId) -> bool:
    return type(gid) is tuple


def running_gid(frame: Frame) -> PassId | None:
    """The backward id ``frame`` is being recomputed for on this thread, or None."""
    for running, gid in reversed(region_stack()):
        if running is frame and gid is not None:
            return gid
    return None


def meta(x: torch.Tensor) -> tuple:
    return (x.shape, x.dtype, x.device)


def unpack(packed: Any) -> Any:
    if not isinstance(packed, Holder):
        return packed  # a tensor saved by a recompute's own graph (backward inside a region)
    try:
        return _unpack(packed)
    except RecursionError as exc:
        # Never let the autograd engine turn this into a bare SystemError.
        raise CheckpointError(
            "Python's recursion limit was hit while recomputing a checkpointed region for "
            "backward (in the region's own code, or regions recomputing each other); see the "
            "RecursionError above. If the code is fine, report this with the model code."
        ) from exc


def _deferred_by_running_recompute(holder: Holder, gid: PassId) -> Deferred | None:
    # The innermost recompute running on this thread (for another pass) that
    # handed this holder to a nested region.
    for _, running in reversed(region_stack()):
        if running is not None and running != gid:
            pending = holder.values.get(running)
            if type(pending) is Deferred:
                return pending
    return None


def _unpack(holder: Holder) -> Any:
    gid = graph_id()
    value = holder.values.get(gid, _MISSING)
    if value is _MISSING:
        pending = _deferred_by_running_recompute(holder, gid)
        if pending is not None:
            # A backward started inside a recompute (``autograd.grad`` in a
            # checkpointed function, double backward) reaches a tensor that a
            # region nested in that recompute saved: that nested region rebuilds
            # it for this pass too. Recomputing the owner instead would run the
            # same ``autograd.grad`` again, and so on without end.
            pending.frame.recompute(gid)
        else:
            holder.owner.recompute(gid)
        value = holder.values.get(gid, _MISSING)
    while type(value) is Deferred:
        value.frame.recompute(gid)
        resolved = holder.values.get(gid, _MISSING)
        if resolved is value:
            raise CheckpointError("internal: a nested region did not fill its saved tensor")
        value = resolved
    if value is _CONSUMED:
        overlap = (
            "Performing two backward calls that overlap (i.e. require the same saved "
            "activation) is not allowed under one torch.utils.checkpoint.GraphExecGroup: "
            "use one group per backward that shares saved tensors, or none. "
            if is_group_id(gid)
            else ""
        )
        raise CheckpointError(
            "Unpack is being triggered for a tensor that was already unpacked once: a "
            f"checkpointed tensor was unpacked twice in one backward pass. {overlap}If you "
            "read ctx.saved_tensors in a custom autograd.Function, read it once per backward."
        )
    if value is _MISSING:
        raise CheckpointError(
            "the recompute of a checkpointed region did not produce a tensor its forward "
            f"saved. {DEBUG_TIP}"
        )
    holder.values[gid] = _CONSUMED
    return value
