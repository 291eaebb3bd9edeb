"""The simulator's view of a plan's offloaded units: what moves, when, and what it costs.

It follows the engine (:mod:`gradckpt.engine.offload`) event for event:

* a unit's moved storages are those its saved tensors live in that it created
  itself (not its inputs, parameters or output), of at least ``min_bytes``;
* their copies out start when the unit's forward ends; the sources are dropped
  when the *next* offloaded unit's forward ends (a one-deep stash), so they
  stay live until then and the copy may overlap that compute;
* the last offloaded unit's sources are still held when backward reaches it:
  they are used as they are (memory as ``keep``, no copy back);
* any other unit's storages are loaded when the next offloaded unit's backward
  begins (its first unpack: the prefetch), so the reload buffers are live
  during that unit's backward too, which can raise the peak; without
  prefetch, at the unit's own first unpack;
* a ``RecomputeOffload`` unit moves its region's kept input instead (its
  chain input, :func:`boundary_storages`): its region no longer holds it, and
  its loads start just before its recompute, which unpacks that input first;
* compute waits for a copy out when its sources are dropped and for a copy
  back at the unit's first unpack; :func:`run_timeline` turns that into stalls.

:func:`step_effect` hands that to the simulator as a generic
:class:`~gradckpt.planning.handlers.effects.StepEffect` (the Offload handler's
``plan_effect``).

Example:
    >>> effect = offload_effect(prof, plan, plan.offload)
    >>> effect.host_bytes, effect.stall
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from gradckpt.engine.decisions import Offload, RecomputeOffload
from gradckpt.planning.handlers.effects import Buffer, StepEffect
from gradckpt.planning.kinds.offload.cost import (
    Compute,
    Issue,
    Timeline,
    Wait,
    run_timeline,
    transfer_seconds,
    unit_stall,
)
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan, UnitChoice
from gradckpt.profiling.records import NEVER, Profile, UnitRecord

__all__ = [
    "MovedUnit",
    "OffloadEffect",
    "boundary_storages",
    "describe_offload",
    "moved_storages",
    "offload_effect",
    "play",
    "stage_stall",
    "step_effect",
]


def moved_storages(profile: Profile, unit: UnitRecord, min_bytes: int) -> tuple[int, ...]:
    """Storage ids the engine moves when ``unit`` is offloaded (see the module docstring).

    Example:
        >>> moved_storages(prof, prof.blocks[0], 4096)
    """
    inside = range(unit.first_op, unit.end_op)
    found = {
        p.storage for p in profile.packs
        if p.unit == unit.index and p.storage >= 0 and p.storage != unit.output
    }  # fmt: skip
    return tuple(
        sorted(
            s for s in found
            if profile.storages[s].producer in inside and profile.storages[s].nbytes >= min_bytes
        )
    )


@dataclass(frozen=True)
class MovedUnit:
    """One offloaded unit in profile terms (positions on the plain step's event line)."""

    path: str
    unit: int
    storages: tuple[int, ...]
    nbytes: int
    close: int  # its forward's last op: copies out start after it
    drop: int  # sources dropped after this position (NEVER: held into backward)
    load: int  # copies back start here (NEVER: none, the sources were held)
    need: int  # its first unpack: its backward begins
    d2h_seconds: float
    h2d_seconds: float
    #: True for a ``RecomputeOffload`` unit: what moves is its region's kept input, and
    #: its backward begins with its recompute, which needs the input back before it.
    boundary: bool = False
    loaded_by: str = ""  # the unit whose backward's start loads this one's bytes
    #: Boundary units: until where the input is held on the device once back (or, if
    #: held into backward, all along): its recompute, and the saved tensors of it.
    until: int = NEVER

    @property
    def held(self) -> bool:
        return self.drop >= NEVER


@dataclass(frozen=True)
class OffloadEffect:
    """What a plan's offload does: the units, the host bytes, the stalls."""

    units: tuple[MovedUnit, ...]
    moved_packs: frozenset[int]  # packs whose storage stops holding device memory at drop
    host_bytes: int
    stall: float
    stall_by_unit: dict[str, float]


def _first_unpack(profile: Profile, unit: UnitRecord) -> int:
    return min((p.unpack for p in profile.packs if p.unit == unit.index), default=NEVER)


def play(profile: Profile, events: list[tuple[int, int, object]]) -> Timeline:
    """Copy events ``(position, rank, Issue | Wait)`` played against the profiled compute
    (ordered by position, then rank; :func:`run_timeline`).

    Example:
        >>> play(prof, [(12, 0, Issue("x", 1e-3)), (40, 1, Wait("x"))]).stall
    """
    events = sorted(events, key=lambda e: (e[0], e[1]))
    at = _cumulative_time(profile)
    steps: list[object] = []
    done = 0.0
    for position, _, step in events:
        now = at(position)
        steps.append(Compute(now - done))
        done = now
        steps.append(step)
    return run_timeline(steps)  # type: ignore[arg-type]


def _cumulative_time(profile: Profile):
    ordered = sorted(profile.ops, key=lambda op: op.position)
    positions = [op.position for op in ordered]
    sums = [0.0, *itertools.accumulate(op.time for op in ordered)]

    def at(position: int) -> float:
        """Compute seconds done once every op at or before ``position`` has run."""
        return sums[bisect.bisect_right(positions, position)]

    return at


def boundary_storages(
    profile: Profile, unit: UnitRecord, decision: RecomputeOffload, min_bytes: int
) -> tuple[int, ...]:
    """The storage a ``RecomputeOffload`` unit's engine moves: its input at ``decision.arg``
    (the profile knows it as the unit's chain input), if at least ``min_bytes``.

    Example:
        >>> boundary_storages(prof, prof.blocks[1], RecomputeOffload(0), 4096)
    """
    if decision.arg != unit.chain_arg or unit.chain_input < 0:
        raise ValueError(
            f"the plan moves argument {decision.arg} of {unit.path} to host memory, but the "
            f"profile knows only its chain input (argument {unit.chain_arg}) as the input a "
            "region keeps; plan again rather than editing the decision"
        )
    sid = unit.chain_input
    return (sid,) if profile.storages[sid].nbytes >= min_bytes else ()


def _moves(decision: object, options: OffloadOptions) -> bool:
    # Streamed ``Offload`` units are :mod:`~gradckpt.planning.kinds.offload.stream`'s.
    return isinstance(decision, RecomputeOffload) or (
        isinstance(decision, Offload) and not options.stream
    )


def offload_effect(profile: Profile, plan: Plan, options: OffloadOptions | None) -> OffloadEffect:
    """The offloaded units of ``plan`` (top-level ``offload`` and ``recompute_offload``
    items) and their costs.

    Example:
        >>> offload_effect(prof, plan, OffloadOptions(d2h_bandwidth=25e9)).stall
    """
    options = options or OffloadOptions()
    by_path = {u.path: u for u in profile.units}
    chosen = [
        (by_path[item.path], item.decision) for item in plan.items
        if isinstance(item, UnitChoice) and _moves(item.decision, options) and item.path in by_path
    ]  # fmt: skip
    chosen.sort(key=lambda pair: pair[0].first_op)
    needs = [_first_unpack(profile, u) for u, _ in chosen]
    # Where a unit's backward starts loading: a region's first unpack runs its recompute,
    # whose kept input is unpacked before any of its ops, so loads it starts (its own and
    # the prefetch) come just before that recompute (a recompute sits at need - 1).
    starts = [n - 2 if isinstance(d, RecomputeOffload) else n for n, (_, d) in zip(needs, chosen)]
    units: list[MovedUnit] = []
    for i, (u, decision) in enumerate(chosen):
        boundary = isinstance(decision, RecomputeOffload)
        if boundary:
            sids = boundary_storages(profile, u, decision, options.min_bytes)
        else:
            sids = moved_storages(profile, u, options.min_bytes)
        nbytes = sum(profile.storages[s].nbytes for s in sids)
        last = i + 1 == len(chosen)
        close = profile.ops[u.end_op - 1].position
        drop = NEVER if last else profile.ops[chosen[i + 1][0].end_op - 1].position
        by = i + 1 if options.prefetch else i
        load = NEVER if last else starts[by]
        d2h = transfer_seconds(nbytes, len(sids), options.d2h_bandwidth, options.transfer_latency)
        h2d = 0.0 if last else transfer_seconds(
            nbytes, len(sids), options.h2d_bandwidth, options.transfer_latency
        )  # fmt: skip
        until = _boundary_until(profile, u, sids, needs[i], last) if boundary else NEVER
        units.append(MovedUnit(u.path, u.index, sids, nbytes, close, drop, load, needs[i], d2h,
                               h2d, boundary, "" if last else chosen[by][0].path, until))  # fmt: skip
    moved = frozenset(
        p.id for m in units if not m.held and not m.boundary for p in profile.packs
        if p.unit == m.unit and p.storage in set(m.storages)
    )  # fmt: skip
    stall, by_unit = _stalls(profile, units)
    return OffloadEffect(tuple(units), moved, sum(m.nbytes for m in units), stall, by_unit)


def _boundary_until(
    profile: Profile, unit: UnitRecord, sids: tuple[int, ...], need: int, held: bool
) -> int:
    """Until where a boundary unit's input is on the device in backward.

    Held into backward, the group keeps the source until its region dies (its last
    saved tensor released). Reloaded, the buffer lives through the recompute (which
    ends just before ``need``) and as long as a saved tensor of the recompute views it.
    """
    mine = [p for p in profile.packs if p.unit == unit.index]
    if held:
        return max((p.release for p in mine), default=need)
    return max([need - 1, *(p.release for p in mine if p.storage in sids)])


def step_effect(profile: Profile, effect: OffloadEffect) -> StepEffect:
    """The offload as the simulator applies it: moved storages are held by the stash, not
    their saved tensors (or, for a boundary, not its region), until dropped, and come
    back as reload buffers at the load, live until their saved tensors are released
    (a boundary's: see :func:`_boundary_until`).

    Example:
        >>> step_effect(prof, offload_effect(prof, plan, plan.offload)).buffers
    """
    released: dict[int, int] = {}  # storage -> last release of its moved saved tensors
    for pid in effect.moved_packs:
        pack = profile.packs[pid]
        released[pack.storage] = max(released.get(pack.storage, 0), pack.release)
    dropped = [m for m in effect.units if not m.held]
    live_until = {sid: m.drop for m in dropped for sid in m.storages}
    for m in effect.units:
        if m.boundary and m.held:  # the session keeps the source until its region dies
            live_until.update({sid: m.until for sid in m.storages})
    return StepEffect(
        released_packs=effect.moved_packs,
        live_until=live_until,
        buffers=tuple(
            Buffer(profile.storages[sid].nbytes, m.load, m.until if m.boundary else released[sid])
            for m in dropped
            for sid in m.storages
        ),
        stall=effect.stall,
        host_bytes=effect.host_bytes,
        released_inputs=frozenset(
            (m.unit, sid) for m in effect.units if m.boundary for sid in m.storages
        ),
    )


def _stalls(profile: Profile, units: list[MovedUnit]) -> tuple[float, dict[str, float]]:
    """Play the copies against the profiled compute (see :func:`run_timeline`)."""
    events: list[tuple[int, int, object]] = []
    for i, m in enumerate(units):
        events.append((m.close, 0, Issue(("out", m.path), m.d2h_seconds)))
        if i > 0:  # the previous unit's sources are dropped: wait for their copy
            events.append((m.close, 1, Wait(("out", units[i - 1].path))))
        if not m.held:
            own = m.loaded_by == m.path
            events.append((m.load, 2 if own else 3, Issue(("in", m.path), m.h2d_seconds)))
            events.append((m.need, 4, Wait(("in", m.path))))
    timeline = play(profile, events)
    by_unit: dict[str, float] = {}
    for (_, path), late in timeline.waits.items():
        by_unit[path] = by_unit.get(path, 0.0) + late
    return timeline.stall, by_unit


def stage_stall(
    profile: Profile,
    units: tuple[UnitRecord, ...],
    i: int,
    moved: tuple[int, ...],
    options: OffloadOptions | None,
) -> float:
    """The chain DP's stall estimate for offloading ``units[i]`` alone (:func:`unit_stall`).

    Its copies overlap the next unit's forward (out) and backward (back); the last
    unit's sources are still held when backward reaches it (no copy back).

    Example:
        >>> stage_stall(prof, blocks, 0, moved_storages(prof, blocks[0], 4096), options)
    """
    options = options or OffloadOptions()
    nbytes = sum(profile.storages[s].nbytes for s in moved)
    d2h = transfer_seconds(nbytes, len(moved), options.d2h_bandwidth, options.transfer_latency)
    if i + 1 >= len(units):
        return 0.0  # held into backward: the copy out overlaps the rest of the step
    h2d = transfer_seconds(nbytes, len(moved), options.h2d_bandwidth, options.transfer_latency)
    after = units[i + 1]
    bwd_window = after.bwd_time if options.prefetch else 0.0
    return unit_stall(d2h, h2d, after.fwd_time, bwd_window)


def describe_offload(profile: Profile, plan: Plan) -> dict[str, str]:
    """Per offloaded unit: what moves, when, and the stall the link costs (for ``explain``).

    Example:
        >>> describe_offload(prof, plan)["blocks.0"]
    """
    effect = offload_effect(profile, plan, plan.offload)
    out = {}
    for m in effect.units:
        moved = f"offload {m.nbytes / 2**20:.2f} MiB"
        if m.held:
            out[m.path] = f"{moved}: out after forward, held into backward (no copy back)"
            continue
        back = m.loaded_by
        stall = effect.stall_by_unit.get(m.path, 0.0)
        out[m.path] = f"{moved}: out after forward, back at {back} backward, waits {stall * 1e3:.2f} ms"
    return out
