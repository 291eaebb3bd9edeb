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
of each size is live: a buffer over the region's backward. A plain ``nn.Linear``
head does its backward's work in the forward instead (:func:`_early_effect`).

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
    if span.linear:
        return _early_effect(profile, span, chunks)
    storages = profile.storages
    resized = {s: span.slice_bytes(storages[s].nbytes, chunks) for s in span.per_token}
    buffers: list[Buffer] = []
    if span.backward:
        start = profile.ops[span.backward[0]].position - 1
        stop = profile.ops[span.backward[-1]].position + 1
        for s in sorted(span.handed_on):
            # Autograd makes one more per slice before adding it.
            buffers.append(Buffer(storages[s].nbytes, start, stop))
    return StepEffect(resized=resized, buffers=tuple(buffers))


def _early_effect(profile: Profile, span: HeadSpan, chunks: int) -> StepEffect:
    """A plain ``nn.Linear`` head: its backward's work is done in the forward, slice by
    slice (:mod:`gradckpt.engine.chunking.linear_loss`), and nothing is recomputed.

    Each slice's backward runs once its forward is done, so at the end of the loss's
    forward the step holds, for a moment, what the plain backward holds of per-token
    storages at its fullest (its own and the forward's it reads), at one slice's size
    (no more than that: the forward's own are one slice's and come before); in
    backward it makes none (size 0 there). What the backward hands on (the head
    input's and the weight's gradients, accumulated in place) lives from the head's
    forward until the plain step's own would.
    """
    storages, ops = profile.storages, profile.ops
    made_bwd = {s for i in span.backward for s in ops[i].outputs}
    resized = {
        s: 0 if s in made_bwd else span.slice_bytes(storages[s].nbytes, chunks)
        for s in span.per_token
    }
    start = ops[span.first_op].position - 1
    # Just after the forward's own per-token storages die (one past the loss's last op):
    # one slice's forward and backward come and go before the next slice's.
    after = ops[span.end_op - 1].position + 2
    buffers = []
    fullest = _fullest_backward(profile, span)
    if fullest:
        buffers.append(Buffer(span.slice_bytes(fullest, chunks), after, after + 1))
    for s in sorted(span.handed_on):
        # Under autocast each slice's bf16 product before it is added is the plain
        # step's own bf16 gradient, which the step keeps where it made it.
        # Freed just before the plain step makes its own (the same tensor, handed on).
        buffers.append(Buffer(storages[s].nbytes, start, max(start, storages[s].alloc - 1)))
    # The head's own casts (its weight's, under autocast) serve every slice's backward.
    head = profile.units[span.unit]
    casts = {
        s: after + 1 for i in range(head.first_op, head.end_op) for s in ops[i].outputs
        if s not in span.per_token
    }  # fmt: skip
    return StepEffect(resized=resized, buffers=tuple(buffers), live_until=casts)


def _fullest_backward(profile: Profile, span: HeadSpan) -> int:
    """The most bytes of per-token storages live at once in the plain step's backward
    of the head and its loss."""
    if not span.backward:
        return 0
    ops, storages = profile.ops, profile.storages
    first, last = ops[span.backward[0]].position, ops[span.backward[-1]].position
    events = []
    for s in span.per_token:
        record = storages[s]
        alloc, free = max(record.alloc, first), min(record.free, last + 1)
        if alloc < free:
            events += [(alloc, record.nbytes), (free, -record.nbytes)]
    live = fullest = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):  # frees first at a tie
        live += change
        fullest = max(fullest, live)
    return fullest
