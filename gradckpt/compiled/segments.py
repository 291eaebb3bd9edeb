"""Segments inside the compiled graph: one checkpoint region over several module calls.

A gradckpt segment saves only its first unit's input and recomputes all its
units in backward. The compiler sees one ``checkpoint`` call per unit (the
units are separate module calls; there is no single callable to wrap), and
AOT autograd's partitioner then *saves* the tensor at the boundary of two
consecutive checkpoint regions: ``cleanup_recompute_tags`` makes a region's
output ``MUST_SAVE`` when its user is in a region with a *larger*
``ac_graph_id`` (torch/_functorch/partitioners.py). Regions with the *same* id
are one region to it. So every unit of a segment reports the id of the
segment's first unit: the HOP that traces a checkpoint call sets the id on
the forward context (``fwd_ctx.ac_graph_id = ...``, torch/_higher_order_ops/
wrap.py), and the context here keeps the first unit's and ignores the
others'. Every op of a segment is ``PREFER_RECOMPUTE``: its forward saves
nothing but the segment's input, as in eager.

Ops of the model's own forward *between* two units of a segment are outside
every region; the partitioner may save their outputs (eager recomputes them
with the segment). Transformer stacks call their blocks back to back.

Example:
    >>> gradckpt.apply(model, plan_with_segments)
    >>> gradckpt.compile(model, backend="inductor")  # segments honoured
"""

from __future__ import annotations

from typing import Any

from gradckpt.planning import Plan, Segment

__all__ = ["SegmentId", "segment_contexts", "segment_of"]


class SegmentId:
    """The ``ac_graph_id`` the first unit of one segment was given in this trace."""

    def __init__(self) -> None:
        self.value: Any = None


def segment_of(plan: Plan) -> dict[str, tuple[SegmentId, bool]]:
    """Per unit path inside a top-level segment: the segment's shared id, and if it comes first."""
    found: dict[str, tuple[SegmentId, bool]] = {}
    for item in plan.items:
        if isinstance(item, Segment):
            shared = SegmentId()
            for position, path in enumerate(item.paths):
                found[path] = (shared, position == 0)
    return found


def segment_contexts(shared: SegmentId, first: bool, path: str) -> tuple[Any, Any]:
    """SAC contexts for one unit of a segment: recompute everything, one graph id per segment."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy.__name__ = f"gradckpt_segment_policy({path})"
    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(policy)
    base = type(forward_ctx)

    class SegmentForward(base):  # type: ignore[misc, valid-type]
        """The forward context whose graph id is the segment's."""

        @property
        def ac_graph_id(self) -> Any:
            return shared.value

        @ac_graph_id.setter
        def ac_graph_id(self, value: Any) -> None:
            if first and value is not None:  # the first unit's id names the segment
                shared.value = value

    forward_ctx.__class__ = SegmentForward
    return forward_ctx, recompute_ctx
