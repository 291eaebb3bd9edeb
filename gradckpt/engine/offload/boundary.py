"""Offload what checkpointing keeps: a recomputed region's input goes to host memory.

A checkpointed region frees everything its forward saved but must keep its
input for the recompute (the hidden state a transformer block hands the next).
On a chain of recomputed blocks those inputs are most of what the forward
leaves on the device, so a plan that recomputes every block cannot go below
them. :func:`run_boundary_offloaded` runs a region (any callable that opens
one, e.g. ``run_checkpointed``) inside one :class:`OffloadGroup` of the
model's :class:`OffloadSession` whose only candidate is that input's storage:
the region saves its inputs through autograd (:mod:`gradckpt.engine.inputs`),
so the group's pack hook sees the input and replaces it by a handle; the
region's own hooks, innermost, still take every tensor its ops save.

Everything else is the session's, shared with ``Offload`` units: the copy
starts when the region's forward ends, the source is dropped when the next
offloaded unit's forward ends (one-deep stash), the last group is used in
place, and a group's first unpack, which here is the start of its region's
recompute (``KeptInputs.get``), prefetches the previous group. So the input
comes back one offloaded unit ahead of the recompute that needs it.

Example:
    >>> session = OffloadSession(HostCopyBackend(), min_bytes=4096)
    >>> out = run_boundary_offloaded(session, "layers.3",
    ...                              lambda: run_checkpointed(block, (x,), {}), x)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from gradckpt.engine.offload.session import OffloadSession, storage_key

__all__ = ["boundary_argument", "run_boundary_offloaded"]


def boundary_argument(name: str, args: tuple, kwargs: dict, arg: int) -> torch.Tensor:
    """The tensor at flat position ``arg`` of a call's ``(args, kwargs)``; a clear error if none.

    Example:
        >>> boundary_argument("layers.0", (x, mask), {}, 0) is x
        True
    """
    flat, _ = tree_flatten((args, kwargs))
    found = flat[arg] if 0 <= arg < len(flat) else None
    if not isinstance(found, torch.Tensor):
        raise ValueError(
            f"gradckpt offload: the plan moves argument {arg} of {name} to host memory (its "
            f"kept input), but this call's argument there is {type(found).__name__}; the "
            "forward calls the unit differently than when it was profiled. Plan again."
        )
    return found


def run_boundary_offloaded(
    session: OffloadSession,
    name: str,
    region: Callable[[], Any],
    boundary: torch.Tensor,
    keep: tuple[torch.Tensor, ...] = (),
) -> Any:
    """Run ``region()`` (which opens a checkpointed region) with ``boundary``, the input
    it keeps, offloaded through ``session``.

    Only ``boundary``'s storage moves (the region's other inputs, a mask or
    position embeddings shared by every block, are held elsewhere and stay);
    ``keep`` (the unit's parameters and buffers) never moves.

    Example:
        >>> out = run_boundary_offloaded(session, "h.0", lambda: run_checkpointed(h0, (x,), {}), x)
    """
    exclude = {storage_key(t) for t in keep}
    group = session.open(name, exclude, {storage_key(boundary)})
    with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
        out = region()
    group.close(out)
    return out
