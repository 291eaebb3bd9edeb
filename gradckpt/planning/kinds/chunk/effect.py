"""What a chunked head does to the simulated step beyond its region.

The region (:meth:`ChunkHandler.region <.handler.ChunkHandler.region>`) frees
the head's and the loss's intermediates in the forward and reruns them in
backward, as a recompute would. Slicing then shrinks them: every per-token
storage the region makes, in its forward, its recompute or its backward, is
one slice's size (``resized``); slices run one after another, so one slice's
worth is live at any moment. What the region's backward hands on (the head
input's gradient, the weight's) is whole, and while slices are being
accumulated into it a second one of its size is live (the next slice's,
before the in-place add): a buffer over the region's backward.

Example:
    >>> chunk_effect(prof, head_span(prof), 8).resized
"""

from __future__ import annotations

from gradckpt.planning.handlers.effects import Buffer, StepEffect
from gradckpt.planning.kinds.chunk.span import HeadSpan
from gradckpt.profiling.records import Profile

__all__ = ["chunk_effect"]


def chunk_effect(profile: Profile, span: HeadSpan, chunks: int) -> StepEffect:
    """The plan-wide effect of running ``span`` in ``chunks`` slices.

    Example:
        >>> chunk_effect(prof, head_span(prof), 4).buffers  # the gradients being accumulated
    """
    storages = profile.storages
    resized = {s: span.slice_bytes(storages[s].nbytes, chunks) for s in span.per_token}
    buffers: tuple[Buffer, ...] = ()
    if span.backward:
        start = profile.ops[span.backward[0]].position - 1
        stop = profile.ops[span.backward[-1]].position + 1
        buffers = tuple(Buffer(storages[s].nbytes, start, stop) for s in sorted(span.handed_on))
    return StepEffect(resized=resized, buffers=buffers)
