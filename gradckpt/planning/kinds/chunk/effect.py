"""What a chunked head does to the simulated step beyond its region.

The region (:meth:`ChunkHandler.region <.handler.ChunkHandler.region>`) frees
the head's and the loss's intermediates in the forward and reruns them in
backward, as a recompute would. Slicing then shrinks them: every per-token
storage the region makes, in its forward, its recompute or its backward, is
one slice's size (``resized``); slices run one after another, so one slice's
worth is live at any moment. What the region's backward hands on (the head
input's gradient, the weight's) is whole and made by the first slice, so it
lives from the region's backward on. A plain ``nn.Linear`` head accumulates
into it in place (:mod:`gradckpt.engine.chunking.linear_loss`); any other head's
gradients are gathered by autograd, and while slices are added a second one
of each size is live: a buffer over the region's backward.

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
    buffers: list[Buffer] = []
    if span.backward:
        start = profile.ops[span.backward[0]].position - 1
        stop = profile.ops[span.backward[-1]].position + 1
        for s in sorted(span.handed_on):
            nbytes = storages[s].nbytes
            if not span.linear:  # autograd makes one more per slice before adding it
                buffers.append(Buffer(nbytes, start, stop))
                continue
            # Made by the first slice, before the plain step would make it whole. (Under
            # autocast each slice's bf16 product before it is added is the plain step's
            # own bf16 gradient, which the step keeps where it made it.)
            buffers.append(Buffer(nbytes, start, max(start, storages[s].alloc)))
    return StepEffect(resized=resized, buffers=tuple(buffers))
