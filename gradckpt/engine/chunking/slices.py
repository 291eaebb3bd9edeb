"""Run a token-wise function in slices, each slice a checkpointed region.

The mechanism under the ``Chunk`` decision (:mod:`gradckpt.planning.kinds.chunk`):
a function whose result for a row (a token) depends on that row only, up to a
sum, runs on ``k`` slices of the rows one after another. Each slice is a region
of the engine (:func:`~gradckpt.engine.checkpoint.run_checkpointed`): its
intermediates die with it in the forward, and backward recomputes one slice at a
time, so at most one slice's intermediates live at once. Slices are near-equal
(the first ``rows % k`` are one row longer), so a length not divisible by ``k``
needs nothing special.

Only the order of floating-point sums changes: a sum over slices is a sum of
partial sums, and a weight's gradient is accumulated slice by slice.

Inside an enclosing region (a recomputed block) the slices run plainly in its
forward, and in its recompute each slice is a nested region, which backward
recomputes again when it reaches the slice. Run there, a slice's forward would
be work thrown away: its saved tensors become the nested region's to rebuild,
and every slice before the one holding the block's last saved tensor would run
whole (its second linear too). So a ``deferrable`` chunk (one that draws no
random numbers: each slice's region then starts from the same RNG state) whose
slices hold the enclosing recompute's last saved tensor opens their regions
there without running them: their inputs are kept, the enclosing region's
holders are handed to them (:meth:`Frame.hand_to`), and the recompute stops
where it would have. Its forward recorded how many tensors each slice saved
(``Frame.chunk_spans``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradckpt.engine.checkpoint import region_for, run_checkpointed
from gradckpt.engine.holders import CheckpointError, active_frame

__all__ = ["chunked_cat", "chunked_sum", "token_slices"]


def token_slices(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``chunks`` near-equal slices of ``rows`` rows (never empty).

    Example:
        >>> token_slices(10, 4)
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    chunks = max(1, min(chunks, rows))
    size, extra = divmod(rows, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        stop = start + size + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def _rows(args: Sequence[torch.Tensor]) -> int:
    rows = {a.shape[0] for a in args}
    if len(rows) != 1:
        raise ValueError(
            f"chunked: the sliced arguments must have the same number of rows, got {sorted(rows)}"
        )
    return rows.pop()


def _slices(
    fn: Callable[..., Any], chunks: int, sliced: Sequence[torch.Tensor], shared: dict[str, Any],
    name: str, deferrable: bool = False,
) -> list[Any]:  # fmt: skip
    bounds = token_slices(_rows(sliced), chunks)
    top = active_frame() if deferrable and torch.is_grad_enabled() else None
    if top is not None and top[1] is not None:
        _defer(fn, bounds, sliced, shared, name, *top)  # returns only when it cannot defer
    recording = top is not None and top[1] is None  # the enclosing region's forward
    first = len(top[0].slots) if recording else 0
    ends = []
    results = []
    for i, (start, stop) in enumerate(bounds):
        parts = tuple(a.narrow(0, start, stop - start) for a in sliced)
        results.append(run_checkpointed(fn, parts, shared, name=f"{name}[{i}]"))
        if recording:
            ends.append(len(top[0].slots))
    if recording:
        top[0].chunk_spans[first] = tuple(ends)
    return results


def _defer(
    fn: Callable[..., Any], bounds: list[tuple[int, int]], sliced: Sequence[torch.Tensor],
    shared: dict[str, Any], name: str, frame: Any, gid: Any,
) -> None:  # fmt: skip
    """In ``frame``'s recompute: open the slices' regions unrun, up to the slice that
    holds the recompute's last saved tensor, where the recompute stops (raises).
    Returns, doing nothing, when the slices must run (see the module docstring)."""
    first = frame.counters.get(gid)
    ends = frame.chunk_spans.get(first)
    if not frame.early_stop or ends is None or len(ends) != len(bounds):
        return
    if frame.stops[gid] >= ends[-1]:
        return  # the block saves more after the chunk: its output is needed
    before = first
    for i, (start, stop) in enumerate(bounds):
        parts = tuple(a.narrow(0, start, stop - start) for a in sliced)
        nested = region_for(fn, parts, shared, name=f"{name}[{i}]")
        # As a forward the recompute stopped inside would be: not completed.
        nested.forward_completed = ends[i] <= frame.stops[gid]
        frame.hand_to(gid, nested, ends[i] - before)  # raises at the recompute's stop
        before = ends[i]
    raise CheckpointError(
        f"gradckpt: the recompute of {frame.name!r} passed the chunk {name!r} without reaching "
        "its last saved tensor; please report this with the model code"
    )


def chunked_sum(
    fn: Callable[..., torch.Tensor], chunks: int, *sliced: torch.Tensor,
    name: str = "chunk", accumulate: torch.dtype | None = torch.float32, **shared: Any,
) -> torch.Tensor:  # fmt: skip
    """``sum over slices of fn(*slices_of(sliced), **shared)``, one checkpointed region per slice.

    ``sliced`` are cut along their first dimension into ``chunks`` near-equal
    slices; ``fn`` must return a scalar per slice. Partial sums are added in
    ``accumulate`` (float32 by default, so a bf16 loss does not round per slice)
    and the total comes back in ``fn``'s dtype.

    Example:
        >>> total = chunked_sum(lambda x: head(x).logsumexp(-1).sum(), 8, hidden)
    """
    parts = _slices(fn, chunks, sliced, shared, name)
    dtype = parts[0].dtype
    total = parts[0] if accumulate is None else parts[0].to(accumulate)
    for part in parts[1:]:
        total = total + (part if accumulate is None else part.to(accumulate))
    return total.to(dtype)


def chunked_cat(
    fn: Callable[..., torch.Tensor], chunks: int, *sliced: torch.Tensor, name: str = "chunk",
    deferrable: bool = False, **shared: Any,
) -> torch.Tensor:  # fmt: skip
    """``fn`` applied slice by slice and the results concatenated along the first dimension.

    For a token-wise function (an MLP, a per-token loss): the result is the whole
    one, but only one slice's intermediates live at once, in forward and backward.
    ``deferrable``: ``fn`` draws no random numbers, so an enclosing region's
    recompute may open the slices without running them (see the module docstring).

    Example:
        >>> y = chunked_cat(mlp, 4, x.reshape(-1, x.shape[-1])).view_as(x)
    """
    return torch.cat(_slices(fn, chunks, sliced, shared, name, deferrable), dim=0)
