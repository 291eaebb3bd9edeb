"""MLP chunking in plans: its regions and memory in the simulator, and when the planner adds it.

A plan names the token-wise modules it runs in slices in ``Plan.token_chunks``
(``(module path, k)`` pairs; :mod:`.token_wise` finds them on the profile).
Beside its block's own decision (keep or recompute), such an MLP is a
checkpointed region over its own ops, entered once per slice
(:func:`add_token_regions`): nested in its block's region when the block is
recomputed (or in a segment), at the top level when the block is kept. Its
hidden activations, in the forward, in the recompute and in backward, are one
slice's size (:func:`token_chunk_effect`); its input and output stay whole, and
two transients are counted: the slices' outputs beside their concatenation at
the end of its forward, and the input's gradient, which each slice's backward
adds into a whole one.

In time it costs one more forward of the MLP (its recompute, priced from the
profile's op times like any recompute) and ``k`` regions of the engine's own
cost. The planner adds it only where it pays: a budget no plan without it meets
(:func:`token_chunked_fit`, chunking the fewest MLPs that bring a plan within it),
or a lower least peak (:func:`token_chunked_least`, all of them).

Example:
    >>> chunked = with_token_chunks(prof, plan, 8)
    >>> simulate(prof, chunked).peak_bytes < simulate(prof, plan).peak_bytes
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from gradckpt.engine.decisions import Keep, Recompute
from gradckpt.planning.handlers.effects import Buffer, StepEffect
from gradckpt.planning.handlers.plan_parts import PlanPart, register_part
from gradckpt.planning.handlers.region import Region
from gradckpt.planning.kinds.chunk.handler import MIN_ROWS, chunking_allowed
from gradckpt.planning.kinds.chunk.token_wise import TokenSpan, token_wise_spans
from gradckpt.planning.plans.plan import Plan, iter_units
from gradckpt.planning.simulation.simulate import Prediction, simulate
from gradckpt.planning.solving.baselines import every_kth_plan, finish
from gradckpt.profiling.records import Profile

__all__ = [
    "TOKEN_CHOICES", "add_token_regions", "allow_token_chunking", "fewest_chunked",
    "token_chunk_effect", "token_chunked_fit", "token_chunked_least", "token_chunked_plans",
    "with_token_chunks",
]  # fmt: skip

#: Slice counts the planner tries for MLPs (at least MIN_ROWS tokens a slice).
TOKEN_CHOICES = (2, 4, 8, 16, 32)


def _spans_of(profile: Profile, plan: Plan) -> list[tuple[TokenSpan, int]]:
    spans, _ = token_wise_spans(profile)
    found = []
    for path, k in plan.token_chunks:
        span = spans.get(path)
        if span is None:
            raise ValueError(
                f"the plan chunks {path} along the tokens, but the profiled step shows no "
                "token-wise module there; plan again (MLP chunking is chosen only where it applies)"
            )
        found.append((span, k))
    return found


def _deepest(regions: list[Region], span: TokenSpan) -> Region | None:
    for region in regions:
        if (
            span.unit in region.units
            and region.first_op <= span.first_op
            and span.end_op <= region.end_op
        ):
            return _deepest(region.children, span) or region
    return None


def add_token_regions(profile: Profile, plan: Plan, tops: list[Region]) -> list[Region]:
    """``tops`` with a region per chunked MLP, nested where its block's region holds it.

    Example:
        >>> add_token_regions(prof, plan, regions)[0].children
    """
    if not plan.token_chunks:
        return tops
    tops = list(tops)
    for span, k in _spans_of(profile, plan):
        inputs = frozenset({span.input}) if span.input >= 0 else frozenset()
        region = Region(
            [span.unit], span.first_op, span.end_op, frozenset(), inputs,
            packs=list(span.packs), repeats=k, label=span.path,
            slice_ops=(span.end_op - span.first_op) + span.backward_ops,
        )  # fmt: skip
        parent = _deepest(tops, span)
        if parent is None:
            tops.append(region)
            tops.sort(key=lambda r: r.first_op)
        else:
            parent.children.append(region)
            parent.children.sort(key=lambda r: r.first_op)
    return tops


def token_chunk_effect(profile: Profile, plan: Plan) -> StepEffect | None:
    """One slice's size for each chunked MLP's per-token storages, and its transients.

    Example:
        >>> token_chunk_effect(prof, plan).resized
    """
    if not plan.token_chunks:
        return None
    storages, ops = profile.storages, profile.ops
    resized: dict[int, int] = {}
    buffers: list[Buffer] = []
    for span, k in _spans_of(profile, plan):
        for sid in span.forward | span.backward:
            resized[sid] = span.slice_bytes(storages[sid].nbytes, k)
        end = ops[span.end_op - 1].position
        buffers.append(Buffer(storages[span.output].nbytes, end - 1, end + 1))  # cat's inputs
        if span.input >= 0:  # each slice's input gradient lands in a whole one, then added
            buffers.append(Buffer(storages[span.input].nbytes, span.backward_start,
                                  span.backward_stop))  # fmt: skip
        buffers += _weight_gradients(profile, span)
    return StepEffect(resized=resized, buffers=tuple(buffers))


def _weight_gradients(profile: Profile, span: TokenSpan) -> list[Buffer]:
    """The MLP's parameters' gradients as its slices make them.

    Each slice uses the weights, so autograd gathers a weight's gradient from every
    slice before it is handed on: the first slice's backward makes it whole, where
    the plain step makes it later in the MLP's backward, and while each later slice's
    is added one more of its size is live (counted where the plain step makes it).
    Without these, a wide MLP over few tokens measured 15% over its prediction; with
    them predictions are at or above the allocator's peak (by 0.4% on HF ViT, by up
    to 4.3% on a toy MLP 8x wide over 64 tokens).
    """
    storages, start = profile.storages, span.backward_start
    buffers = []
    for s in span.weight_grads:
        nbytes, alloc = storages[s].nbytes, storages[s].alloc
        buffers += [Buffer(nbytes, start, max(start, alloc)), Buffer(nbytes, alloc - 1, alloc + 1)]
    return buffers


def _eligible(profile: Profile, plan: Plan, k: int) -> tuple[tuple[str, int], ...]:
    spans, _ = token_wise_spans(profile)
    index = {u.path: u.index for u in profile.units}
    decided = {index[u.path]: u.decision for u in iter_units(plan.items) if u.path in index}
    return tuple(
        (path, k) for path, span in spans.items()
        if span.rows // k >= MIN_ROWS and isinstance(decided.get(span.unit), (Keep, Recompute))
    )  # fmt: skip


def with_token_chunks(profile: Profile, plan: Plan, k: int) -> Plan:
    """``plan`` with every token-wise MLP of a kept or recomputed block in ``k`` slices.

    Example:
        >>> with_token_chunks(prof, least_plan, 8).token_chunks
        (('model.layers.0.mlp', 8), ('model.layers.1.mlp', 8))
    """
    return dataclasses.replace(plan, token_chunks=_eligible(profile, plan, k))


def token_chunked_plans(profile: Profile, plans: list[Plan]) -> list[Plan]:
    """Each of ``plans`` with its MLPs in each of :data:`TOKEN_CHOICES` slices (none if
    chunking is not allowed or the step has no token-wise MLP).

    Example:
        >>> len(token_chunked_plans(prof, [least_plan]))
        5
    """
    if not chunking_allowed() or not token_wise_spans(profile)[0]:
        return []
    out = []
    for plan in plans:
        for k in TOKEN_CHOICES:
            chunked = with_token_chunks(profile, plan, k)
            if chunked.token_chunks:
                out.append(chunked)
    return out


_TOKEN_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "gradckpt_token_chunking", default=True
)


@contextlib.contextmanager
def allow_token_chunking(allowed: bool) -> Iterator[None]:
    """Within the block, the planner adds MLP chunking only if ``allowed`` (and chunking is
    allowed at all): how a benchmark tells what MLP chunking adds to the head's.

    Example:
        >>> with allow_token_chunking(False):
        ...     head_only = Planner(prof).least_peak()
    """
    token = _TOKEN_ALLOWED.set(bool(allowed))
    try:
        yield
    finally:
        _TOKEN_ALLOWED.reset(token)


def _best(
    profile: Profile, plans: list[Plan], budget: int | None
) -> tuple[Plan, Prediction] | None:
    """The fastest of ``plans`` within ``budget`` (None: the leanest, ties to the faster)."""
    best: tuple[Plan, Prediction] | None = None
    for plan in plans:
        pred = simulate(profile, plan)
        if budget is not None and pred.peak_bytes > budget:
            continue
        key = (pred.step_time,) if budget is not None else (pred.peak_bytes, pred.step_time)
        if best is None or key < (
            (best[1].step_time,) if budget is not None else (best[1].peak_bytes, best[1].step_time)
        ):
            best = (plan, pred)
    return best


def token_chunked_least(
    profile: Profile, found: tuple[Plan, Prediction]
) -> tuple[Plan, Prediction]:
    """``found`` (the least peak without MLP chunking), or a leaner plan that chunks MLPs.

    Tried on ``found``'s plan and on recomputing every unit, each in every slice count.

    Example:
        >>> plan, pred = token_chunked_least(prof, least_peak_plan(prof))
    """
    if not _TOKEN_ALLOWED.get():
        return found
    bases = [found[0], every_kth_plan(profile, 1)]
    best = _best(profile, token_chunked_plans(profile, bases), None)
    if best is None or best[1].peak_bytes >= found[1].peak_bytes:
        return found
    return finish(profile, best[0], None, f"{found[0].solver or 'dp'}+mlp-chunk", best[1])


def fewest_chunked(profile: Profile, plan: Plan, k: int, budget: int) -> Plan | None:
    """``plan`` with as few of its MLPs in ``k`` slices as bring it within ``budget``
    (None: not even all of them do).

    Each chunked MLP costs its recompute and ``k`` regions, so chunking all of them
    to shave a few KiB off one block's backward would cost the step for nothing.
    The MLPs are taken in the order of what each alone takes off the peak (most
    first; then the faster; then the step's order: the peak moves on to the next
    block's backward), and the first prefix of that order that fits is the plan:
    ``2n`` simulations for ``n`` MLPs, not ``n**2``.

    Example:
        >>> fewest_chunked(prof, plan, 2, budget).token_chunks
        (('vit.layers.0.mlp', 2),)
    """
    eligible = _eligible(profile, plan, k)
    every = dataclasses.replace(plan, token_chunks=eligible)
    if not eligible or simulate(profile, every).peak_bytes > budget:
        return None
    alone = []
    for i, item in enumerate(eligible):
        pred = simulate(profile, dataclasses.replace(plan, token_chunks=(item,)))
        alone.append((pred.peak_bytes, pred.step_time, i))
    order = [eligible[i] for _, _, i in sorted(alone)]
    for n in range(1, len(order)):  # all of them fit (checked above)
        chosen = set(order[:n])
        candidate = dataclasses.replace(
            plan, token_chunks=tuple(item for item in eligible if item in chosen)
        )
        if simulate(profile, candidate).peak_bytes <= budget:
            return candidate
    return every


def token_chunked_fit(profile: Profile, budget: int, bases: list[Plan]) -> Plan | None:
    """The fastest plan within ``budget`` among ``bases`` with the fewest of their MLPs
    chunked that fit, in each slice count (None: none fits).

    ``bases`` are plans without MLP chunking at several peaks (the DP's, the leanest):
    the planner asks this only when none of them meets ``budget`` as it is.

    Example:
        >>> token_chunked_fit(prof, budget, [least_plan, *dp_plans])
    """
    if not _TOKEN_ALLOWED.get() or not chunking_allowed():
        return None
    candidates = [
        plan for base in bases for k in TOKEN_CHOICES
        if (plan := fewest_chunked(profile, base, k, budget)) is not None
    ]  # fmt: skip
    best = _best(profile, candidates, budget)
    if best is None:
        return None
    return finish(profile, best[0], budget, "dp+mlp-chunk", best[1])[0]


class TokenChunkPart(PlanPart):
    """How the simulator reaches ``Plan.token_chunks`` (see :mod:`gradckpt.planning.handlers.plan_parts`)."""

    def regions(self, profile: Profile, plan: Plan, tops: list[Region]) -> list[Region]:
        return add_token_regions(profile, plan, tops)

    def effect(self, profile: Profile, plan: Plan) -> StepEffect | None:
        return token_chunk_effect(profile, plan)


register_part("token_chunks", TokenChunkPart())
