"""Saved-tensor holders, their unpack hook, and the stack of running regions.

While a region runs its forward, autograd stores a :class:`Holder` in place of
each tensor it saves. The first unpack in a backward pass asks the holder's
region to recompute (once per pass, keyed by the graph task id); values are
handed out once and then forgotten, so recomputed tensors die as soon as
backward has used them. A holder may instead hold a :class:`Deferred`: its
value will come from a nested region's own recompute.

The stack of running regions is thread-local, as autograd's hooks are: it says
whether code runs inside a region's forward (nested regions are no-ops there)
or inside a recompute (nested regions become real).
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gradckpt.engine.frame import Frame

__all__ = [
    "DEBUG_TIP",
    "CheckpointError",
    "Deferred",
    "Holder",
    "active_frame",
    "graph_id",
    "in_region_forward",
    "meta",
    "region_stack",
    "unpack",
]


class CheckpointError(RuntimeError):
    """The recompute of a region did not reproduce what its forward saved."""


DEBUG_TIP = (
    "The region must run the same ops on the same shapes in its recompute as in its "
    "forward (no data-dependent control flow on changed state). Pass debug=True to "
    "gradckpt.checkpoint to see both op sequences."
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


_CONSUMED = object()
_MISSING = object()
_LOCAL = threading.local()
_fresh_ids = itertools.count(start=1 << 62)


def region_stack() -> list[tuple[Frame, int | None]]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def active_frame() -> tuple[Frame, int | None] | None:
    """The innermost running region and its backward id (None during its forward)."""
    stack = region_stack()
    return stack[-1] if stack else None


def in_region_forward() -> bool:
    """True while a region runs its forward: regions opened there are no-ops."""
    top = active_frame()
    return top is not None and top[1] is None


def graph_id() -> int:
    gid = torch._C._current_graph_task_id()
    # Unpacking outside backward (e.g. reading grad_fn._saved_*) gets a fresh
    # id, so it recomputes rather than reading a stale pass.
    return next(_fresh_ids) if gid == -1 else gid


def meta(x: torch.Tensor) -> tuple:
    return (x.shape, x.dtype, x.device)


def unpack(packed: Any) -> Any:
    if not isinstance(packed, Holder):
        return packed  # a tensor saved by a recompute's own graph (backward inside a region)
    holder = packed
    gid = graph_id()
    value = holder.values.get(gid, _MISSING)
    if value is _MISSING:
        holder.owner.recompute(gid)
        value = holder.values.get(gid, _MISSING)
    while type(value) is Deferred:
        value.frame.recompute(gid)
        resolved = holder.values.get(gid, _MISSING)
        if resolved is value:
            raise CheckpointError("internal: a nested region did not fill its saved tensor")
        value = resolved
    if value is _CONSUMED:
        raise CheckpointError(
            "a checkpointed tensor was unpacked twice in one backward pass; if you read "
            "ctx.saved_tensors in a custom autograd.Function, read it once per backward."
        )
    if value is _MISSING:
        raise CheckpointError(
            "the recompute of a checkpointed region did not produce a tensor its forward "
            f"saved. {DEBUG_TIP}"
        )
    holder.values[gid] = _CONSUMED
    return value
