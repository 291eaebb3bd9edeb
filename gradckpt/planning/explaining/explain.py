"""``explain``: every tensor kept for backward, why, and where the peak is.

The question behind it is the one users ask when checkpointing "doesn't lower
my peak": what does backward keep, which of it does the plan recompute, and is
the peak made of kept activations at all (or of gradients and temporaries,
which no checkpointing removes)?

Each row is one *storage* created during the step and saved for backward (a
storage saved by several ops, or saved as a view, counts once). Under a plan it
is

* ``kept``: saved by a unit that runs plainly (or by code outside every unit);
* ``region input``: an input of a checkpointed region, which keeps it;
* ``selective``: the output of an op that a selective region keeps;
* ``recomputed``: saved only inside checkpointed regions: made again in backward.

Tensors that existed before the step (parameters, the batch) are not rows:
keeping them costs nothing extra.

Example:
    >>> ex = gradckpt.explain(model, loss_fn)                   # the plain step
    >>> ex = gradckpt.explain(model, loss_fn, budget=0.5)       # under a plan
    >>> print(ex.table()); ex.kept_bytes, ex.peak.phase
"""

from __future__ import annotations

from gradckpt.engine.decisions import Offload, RecomputeOffload
from gradckpt.planning.explaining.explanation import (
    OUTSIDE,
    STATUSES,
    Explanation,
    PeakInfo,
    SavedStorage,
    UnitCost,
    format_shape,
)
from gradckpt.planning.handlers.region import Region
from gradckpt.planning.handlers.registry import handler_for
from gradckpt.planning.kinds.offload.sim import describe_offload, offload_effect
from gradckpt.planning.kinds.offload.stream import describe_streamed, streamed_storages
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan, Segment, UnitChoice
from gradckpt.planning.simulation.regions import regions_of
from gradckpt.planning.simulation.simulate import Prediction, simulate
from gradckpt.profiling.records import NEVER, Profile

# The result types live in gradckpt.planning.explaining.explanation (which has no __all__
# of its own); this is their public list, where callers have always imported them.
__all__ = [
    "OUTSIDE",
    "STATUSES",
    "Explanation",
    "PeakInfo",
    "SavedStorage",
    "UnitCost",
    "explain",
    "format_shape",
]


# --------------------------------------------------------------------------- main API


def explain(prof: Profile, plan: Plan | None = None) -> Explanation:
    """Every storage the step of ``prof`` keeps for backward under ``plan``, why, the
    totals and the peak (``plan=None``: the plain step).

    For a model, or a plan made for a budget first, call :func:`gradckpt.explain`
    (or :meth:`gradckpt.planning.planner.Planner.explain`).

    Returns:
        An :class:`Explanation`: ``rows``, ``units``, ``kept_bytes``, ``recomputed_bytes``,
        ``peak``; ``table()`` and ``to_json()``.

    Example:
        >>> print(explain(prof, plan).table())
    """
    if not isinstance(prof, Profile):
        raise TypeError(
            f"explain takes a Profile, got {type(prof).__name__}; for a model call "
            "gradckpt.explain(model, loss_fn)"
        )
    return _explain(prof, plan)


# --------------------------------------------------------------------------- implementation


def _plain(prof: Profile) -> Plan:
    return Plan(tuple(UnitChoice(u.path) for u in prof.units if u.plannable), prof.fingerprint)


def _offloads(plan: Plan) -> bool:
    """Whether any top-level unit of ``plan`` is offloaded to host memory."""
    moving = (Offload, RecomputeOffload)  # saved tensors, or a recomputed unit's input
    return any(isinstance(getattr(i, "decision", None), moving) for i in plan.items)


def _token_regions(regions: list[Region]) -> list[Region]:
    """The token-wise (MLP) regions among ``regions`` and their children, at any depth."""
    out = []
    for region in regions:
        if region.label:
            out.append(region)
        out.extend(_token_regions(region.children))
    return out


def _label(region: Region, prof: Profile) -> str:
    if region.label:
        return f"MLP {region.label} (in {region.repeats} slices)"
    paths = [prof.units[i].path for i in region.units]
    if len(paths) == 1:
        return f"region {paths[0]}"
    return f"segment {paths[0]}..{paths[-1]}"


def _decisions(prof: Profile, plan: Plan | None) -> dict[str, str]:
    out = {}
    for u in prof.units:
        if u.plannable:
            out[u.path] = "keep"
        else:  # an older profile's unit of all calls of a shared module, or one with no op
            out[u.path] = f"keep (called {u.calls}x, not plannable)" if u.calls > 1 else "keep"
    if plan is None:
        return out

    def visit(items: tuple, segment: str) -> None:
        for item in items:
            if isinstance(item, Segment):
                inner = f"segment {item.paths[0]}..{item.paths[-1]}"
                visit(item.items, segment or inner)
                continue
            mode = handler_for(item.decision).explain(item.decision)
            out[item.path] = f"in {segment}, {mode} there" if segment else mode

    visit(plan.items, "")
    if _offloads(plan):
        out.update(describe_offload(prof, plan))
        out.update(describe_streamed(prof, plan))
    for path, chunks in plan.token_chunks:  # said beside the block's own decision
        block = next((u.path for u in prof.units if path.startswith(u.path + ".")), None)
        if block is not None:
            out[block] = (f"{out.get(block, 'keep')}; MLP {path} in {chunks} slices of tokens "
                          "(its hidden never whole, exact up to the order of sums)")  # fmt: skip
    return out


def _explain(prof: Profile, plan: Plan | None) -> Explanation:
    regions = regions_of(prof, plan) if plan is not None else []
    top_of_unit = {u: r for r in regions if not r.label for u in r.units}
    # A chunked region also holds the saved tensors of the loss after its unit.
    region_of_pack = {pid: r for r in regions if r.repeats > 1 and not r.label for pid in r.packs}
    sliced_pack = {pid: r for r in _token_regions(regions) for pid in r.packs}
    input_of: dict[int, Region] = {}
    kept_output_of: dict[int, tuple[Region, int]] = {}
    for region in regions:
        for sid in region.inputs:
            input_of.setdefault(sid, region)
        for op in region.save:
            for sid in prof.ops[op].outputs:
                kept_output_of.setdefault(sid, (region, op))
    packs_of: dict[int, list[int]] = {}
    pre_existing = 0
    for pack in prof.packs:
        if pack.storage < 0:
            pre_existing += 1
        else:
            packs_of.setdefault(pack.storage, []).append(pack.id)

    def path(unit: int) -> str:
        return prof.units[unit].path if unit >= 0 else OUTSIDE

    moved = _moved(prof, plan)
    rows: list[tuple[int, SavedStorage]] = []
    for sid in sorted(set(packs_of) | set(input_of) | set(kept_output_of)):
        storage = prof.storages[sid]
        packs = [prof.packs[i] for i in packs_of.get(sid, ())]
        plain = [
            p for p in packs
            if p.unit not in top_of_unit and p.id not in region_of_pack and p.id not in sliced_pack
        ]  # fmt: skip
        if plain:
            unit = plain[0].unit
            status = "kept"
            if unit < 0:
                why = "saved outside every unit (the loss or glue code): kept"
            elif not prof.units[unit].plannable:
                why = f"{path(unit)} runs {prof.units[unit].calls} times: kept (not plannable)"
            elif sid in moved:
                status, why = "offloaded", moved[sid]
            else:
                why = f"{path(unit)} runs plainly: kept"
        elif sid in input_of and sid in moved:  # a recomputed unit's input, offloaded
            unit, status, why = input_of[sid].units[0], "offloaded", moved[sid]
        elif sid in input_of:
            region = input_of[sid]
            unit, status = region.units[0], "region input"
            why = f"input of checkpointed {_label(region, prof)}: kept until its backward"
        elif packs and packs[0].id in sliced_pack:
            region = sliced_pack[packs[0].id]
            unit, status = region.units[0], "recomputed"
            why = (f"in {region.repeats} slices of chunked MLP {region.label}: one slice at a "
                   "time, recomputed")  # fmt: skip
        elif sid in kept_output_of:
            region, op = kept_output_of[sid]
            unit, status = prof.ops[op].unit, "selective"
            why = f"output kept by the selective policy of {_label(region, prof)}"
        elif packs[0].id in region_of_pack:
            region = region_of_pack[packs[0].id]
            unit, status = region.units[0], "recomputed"
            why = (f"in {region.repeats} slices of chunked {_label(region, prof)} and its loss: "
                   "one slice at a time, never whole, recomputed")  # fmt: skip
        else:
            unit, status = packs[0].unit, "recomputed"
            why = f"inside checkpointed {_label(top_of_unit[unit], prof)}: recomputed"
        first = packs[0] if packs else None
        shape = first.shape if first else _input_shape(prof, sid)
        producer = prof.ops[storage.producer] if storage.producer < len(prof.ops) else None
        row = SavedStorage(
            unit=path(unit), is_block=unit >= 0 and prof.units[unit].is_block,
            op=producer.name if producer else "?", shape=shape,
            dtype=first.dtype if first else "", nbytes=storage.nbytes, status=status, why=why,
            storage=sid, saved_by=len(packs),
        )  # fmt: skip
        order = min((p.position for p in packs), default=storage.alloc)
        rows.append((order, row))
    rows.sort(key=lambda r: r[0])
    ordered = tuple(r for _, r in rows)
    kept = sum(r.nbytes for r in ordered if r.kept)
    recomputed = sum(r.nbytes for r in ordered if not r.kept)
    pred = simulate(prof, plan if plan is not None else _plain(prof))
    units = _unit_costs(prof, plan, pred, ordered)
    return Explanation(
        rows=ordered, units=units, kept_bytes=kept, recomputed_bytes=recomputed,
        pre_existing_saved=pre_existing, peak=_peak(prof, pred, regions, ordered),
        plain_peak_bytes=prof.measured_peak_bytes, plan=plan,
    )  # fmt: skip


def _moved(prof: Profile, plan: Plan | None) -> dict[int, str]:
    """Storage id -> why, for what the plan's offloaded units move to host memory."""
    if plan is None or not _offloads(plan):
        return {}
    effect = offload_effect(prof, plan, plan.offload)
    out = {}
    for m in effect.units:
        if m.held:
            continue
        for sid in m.storages:
            what = "input of recomputed " + m.path if m.boundary else "offloaded"
            out[sid] = (f"{what} to host after {m.path}'s forward, back at "
                        f"{m.loaded_by}'s backward")  # fmt: skip
    options = plan.offload or OffloadOptions()
    if options.stream:
        for s in streamed_storages(prof, plan, options):
            if s.output:
                continue
            out[s.storage] = f"streamed to host when {s.path} saved it, back one ahead of its use"
    return out


def _input_shape(prof: Profile, sid: int) -> tuple[int, ...] | None:
    shapes = dict(prof.input_shapes)
    for u in prof.units:
        if u.chain_input == sid and u.path in shapes:
            return tuple(shapes[u.path])
    return None


def _unit_costs(
    prof: Profile, plan: Plan | None, pred: Prediction, rows: tuple[SavedStorage, ...]
) -> tuple[UnitCost, ...]:
    decisions = _decisions(prof, plan)
    times = pred.recompute_by_unit
    kept: dict[str, int] = {}
    recomputed: dict[str, int] = {}
    for r in rows:
        table = kept if r.kept else recomputed
        table[r.unit] = table.get(r.unit, 0) + r.nbytes
    out = [
        UnitCost(u.path, u.is_block, decisions[u.path], kept.get(u.path, 0),
                 recomputed.get(u.path, 0), times.get(u.index, 0.0), u.calls)
        for u in prof.units
    ]  # fmt: skip
    if OUTSIDE in kept or OUTSIDE in recomputed or -1 in times:
        out.append(UnitCost(OUTSIDE, False, "keep (not a unit)", kept.get(OUTSIDE, 0),
                            recomputed.get(OUTSIDE, 0), times.get(-1, 0.0)))  # fmt: skip
    return tuple(out)


def _kept_until(prof: Profile, regions: list[Region], rows: tuple[SavedStorage, ...]) -> dict:
    """Free position of every kept storage under the plan (the simulator's rule)."""
    top_of_unit = {u: r for r in regions if not r.label for u in r.units}
    sliced = {pid for r in regions if r.label for pid in r.packs}
    held: dict[int, int] = {}
    for region in regions:
        releases = [prof.packs[i].release for i in region.packs]
        death = max(releases) if releases else prof.ops[region.end_op - 1].position + 1
        for sid in [*region.inputs, *(s for op in region.save for s in prof.ops[op].outputs)]:
            held[sid] = max(held.get(sid, 0), death)
    packs_of: dict[int, list[int]] = {}
    for p in prof.packs:
        if p.unit not in top_of_unit and p.id not in sliced:
            packs_of.setdefault(p.storage, []).append(p.release)
    out = {}
    for r in rows:
        if not r.kept:
            continue
        s = prof.storages[r.storage]
        if s.producer >= prof.forward_ops:
            out[r.storage] = s.free
            continue
        free = s.natural_free if s.natural_free != NEVER else s.free
        free = max([free, *packs_of.get(r.storage, ())])
        out[r.storage] = max(free, held.get(r.storage, 0))
    return out


def _peak(
    prof: Profile, pred: Prediction, regions: list[Region], rows: tuple[SavedStorage, ...]
) -> PeakInfo:
    where = pred.peak_position
    op = next((o for o in prof.ops if o.position >= where), prof.ops[-1])
    workspace = pred.peak_workspace_bytes
    if workspace:  # the op whose kernel workspace is part of the peak (maybe a recompute)
        op = prof.ops[pred.peak_workspace_op]
    until = _kept_until(prof, regions, rows)
    kept = sum(
        prof.storages[sid].nbytes
        for sid, free in until.items()
        if prof.storages[sid].alloc <= where < free
    )
    # What forward/backward made at its peak (the whole step's resident bytes apart).
    created = max(0, pred.fwd_bwd_peak_bytes - prof.param_bytes - prof.resident_bytes)
    kept = min(kept, created - workspace)
    return PeakInfo(
        peak_bytes=pred.fwd_bwd_peak_bytes, param_bytes=prof.param_bytes, kept_bytes=kept,
        other_bytes=created - kept - workspace, phase="backward" if op.backward else "forward",
        unit=prof.units[op.unit].path if op.unit >= 0 else OUTSIDE, op=op.name,
        workspace_bytes=workspace, resident_bytes=prof.resident_bytes,
        optimizer_step_bytes=pred.peak_bytes if pred.peak_bytes > pred.fwd_bwd_peak_bytes else 0,
    )  # fmt: skip
