"""``Chunk``: the head and the loss after it run in slices of tokens, each recomputed.

The planner offers ``Chunk(k)`` on the one unit :func:`~.span.head_span` finds
(an LM head whose output only a cross-entropy reads), for ``k`` in
:data:`CHOICES` leaving at least :data:`MIN_ROWS` tokens per slice, unless
chunking is switched off (:func:`allow_chunking`, which ``Planner(chunking=False)``
and ``chunking=False`` on the API verbs use). In profile terms a chunked head is
a region over the head and the loss whose per-token storages are one slice's
size (:mod:`.effect`), entered once per slice; its recompute reruns the head and
the loss once in all, except after a plain ``nn.Linear`` head: its chunked loss
makes its gradients in the forward, so its region reruns nothing and the effect
places the backward's storages there. At run time the head returns lazy logits
(:mod:`gradckpt.engine.chunking.lazy`) and the loss consumes them slice by slice.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gradckpt.engine.chunking.lazy import lazy_logits
from gradckpt.engine.chunking.linear_loss import LinearHead
from gradckpt.engine.decisions import Chunk, Decision
from gradckpt.engine.holders import CheckpointError
from gradckpt.planning.handlers.effects import StepEffect
from gradckpt.planning.handlers.engine_counts import EngineCounts
from gradckpt.planning.handlers.lookup import Lookup
from gradckpt.planning.handlers.region import Region
from gradckpt.planning.handlers.registry import KindHandler, register
from gradckpt.planning.kinds.chunk.effect import chunk_effect
from gradckpt.planning.kinds.chunk.span import HeadSpan, head_span
from gradckpt.planning.simulation.per_profile import per_profile
from gradckpt.profiling.records import Profile, UnitRecord

__all__ = ["CHOICES", "MIN_ROWS", "ChunkHandler", "allow_chunking", "chunking_allowed"]

#: Slice counts the planner offers (each one more stage option of the head).
CHOICES = (2, 4, 8, 16, 32, 64)
#: Fewest tokens a slice may hold: below, per-slice costs outweigh what it saves.
MIN_ROWS = 16

_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("gradckpt_chunking", default=True)


def chunking_allowed() -> bool:
    """Whether the planner may offer ``Chunk`` now (see :func:`allow_chunking`)."""
    return _ALLOWED.get()


@contextlib.contextmanager
def allow_chunking(allowed: bool) -> Iterator[None]:
    """Within the block, the planner offers ``Chunk`` only if ``allowed``.

    Example:
        >>> with allow_chunking(False):
        ...     plan = solve(prof, budget)  # keep / recompute / selective only
    """
    token = _ALLOWED.set(bool(allowed))
    try:
        yield
    finally:
        _ALLOWED.reset(token)


@per_profile
def _span(profile: Profile) -> HeadSpan:
    return head_span(profile)


def span_of(profile: Profile, unit: UnitRecord) -> HeadSpan | None:
    """The chunkable region starting at ``unit``, or None."""
    span = _span(profile)
    return span if not span.why_not and span.unit == unit.index else None


class _HeadCall:
    """The head's plain forward on one slice, its other arguments fixed (an object: picklable)."""

    def __init__(self, plain: Any, rest: tuple, kwargs: dict) -> None:
        self.plain, self.rest, self.kwargs = plain, rest, kwargs

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.plain(hidden, *self.rest, **self.kwargs)


def _refuse_ddp_sink(path: str) -> None:
    """Raise inside a DDP forward that routes its outputs through its sink.

    With ``static_graph`` or ``find_unused_parameters`` DDP passes only outputs
    that have a ``grad_fn`` through its sink, whose backward starts the gradient
    synchronisation; lazy logits have none, so the ranks' gradients would never
    be averaged (measured: each rank kept its own).
    """
    module = sys.modules.get("torch.nn.parallel.distributed")
    ddp = getattr(getattr(module, "DistributedDataParallel", None), "_active_ddp_module", None)
    if ddp is None:
        return
    why = [name for name in ("static_graph", "find_unused_parameters") if getattr(ddp, name, False)]
    if why:
        raise CheckpointError(
            f"gradckpt: the plan chunks {path}, but it runs inside DistributedDataParallel with "
            f"{' and '.join(why)}=True, which would not synchronise the gradients of a chunked "
            "head (its logits are lazy and DDP's sink skips them). Plan with chunking=False "
            "(gradckpt.integrations.distributed.fit_for_ddp(..., chunking=False)), or wrap the "
            f"model without {' or '.join(why)}."
        )


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear``, or a subclass that keeps its forward (torchtitan's ``Linear``)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


class ChunkHandler(KindHandler):
    """The head and its loss in ``chunks`` slices; see the module docstring."""

    decision = Chunk
    opens_region = True  # runs eagerly: a compiled caller graph-breaks at the head
    compiled_body = False
    nested = False  # inside a segment's recompute the head runs as the segment's forward ran it

    def stage_options(self, profile: Profile, unit: UnitRecord, look: Lookup) -> list[Decision]:
        span = span_of(profile, unit) if chunking_allowed() else None
        if span is None:
            return []
        return [Chunk(k) for k in CHOICES if span.rows // k >= MIN_ROWS]

    def option_name(self, decision: Decision, index: int) -> str:
        assert isinstance(decision, Chunk)
        return f"chunk{decision.chunks}"

    def recompute_seconds(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> float:
        span = span_of(profile, unit)
        if span is None or span.linear:  # a linear head: gradients made in the forward
            return 0.0
        return sum(op.time for op in profile.ops[span.first_op : span.end_op])

    def engine_counts(self, profile: Profile, unit: UnitRecord, decision: Decision) -> EngineCounts:
        span = span_of(profile, unit)
        assert isinstance(decision, Chunk)
        if span is None:
            return EngineCounts()
        k = decision.chunks
        sliced = (k - 1) * _slice_ops(span)
        if span.linear:  # no region: one autograd call per slice, nothing replayed
            return EngineCounts(regions=k, sliced_ops=sliced)
        ops = span.end_op - span.first_op
        return EngineCounts(regions=k, recompute_ops=k * ops, saved_tensors=k * span.saved,
                            sliced_ops=sliced)  # fmt: skip

    def region(self, profile: Profile, unit: UnitRecord, decision: Decision) -> Region | None:
        span = span_of(profile, unit)
        assert isinstance(decision, Chunk)
        if span is None:
            raise ValueError(
                f"the plan chunks {unit.path}, but the profiled step gives no head and loss to "
                f"chunk there: {_span(profile).why_not}. Plan again (chunking is chosen only "
                "where it applies)."
            )
        return Region(
            [unit.index], span.first_op, span.end_op, frozenset(), frozenset(unit.inputs),
            packs=list(span.loss_packs), repeats=decision.chunks, reruns=not span.linear,
            slice_ops=_slice_ops(span),
        )  # fmt: skip

    def plan_effect(self, profile: Profile, plan: Any) -> StepEffect | None:
        chunked = [u for u in plan.items if isinstance(getattr(u, "decision", None), Chunk)]
        if not chunked:
            return None
        (choice,) = chunked  # head_span finds one head per step
        return chunk_effect(profile, _span(profile), choice.decision.chunks)

    def run(self, unit: Any, args: tuple, kwargs: dict, *, in_recompute: bool) -> Any:
        if in_recompute or not args or not isinstance(args[0], torch.Tensor):
            return unit.call_in_region(args, kwargs)  # as the segment's forward ran it
        _refuse_ddp_sink(unit.path)
        module = unit.module
        if _plain_linear(module) and len(args) == 1 and not kwargs:
            head: Any = LinearHead(module.weight, module.bias)  # backward done in place
        else:
            head = _HeadCall(unit.plain, args[1:], kwargs)
        return lazy_logits(head, args[0], unit.decision.chunks, name=unit.path)

    def describe(self, decision: Decision) -> str:
        assert isinstance(decision, Chunk)
        return (
            f"chunk      {decision.chunks} slices of tokens: the head and its loss, logits never "
            "whole (exact up to the order of sums)"
        )

    def explain(self, decision: Decision) -> str:
        assert isinstance(decision, Chunk)
        return f"chunk ({decision.chunks} slices with the loss; logits never whole)"


def _slice_ops(span: HeadSpan) -> int:
    """Ops one slice of the head and its loss runs: its forward's and its backward's."""
    return (span.end_op - span.first_op) + len(span.backward)


register(ChunkHandler())
