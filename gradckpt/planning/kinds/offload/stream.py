"""The simulator's view of streamed offload (``OffloadOptions(stream=True)``).

Grouped offload (:mod:`gradckpt.planning.kinds.offload.sim`) moves a unit's
saved tensors when its forward ends and brings all of them back before its
backward, so a unit's backward still holds everything it saved: the least
peak with it is the least peak of recompute. Streamed offload follows the
engine's stream mode (:class:`gradckpt.engine.offload.session.OffloadGroup`)
tensor by tensor:

* **out when saved**: each storage a unit's forward creates and autograd
  saves (not its output, at least ``min_bytes``) is copied to host at its
  first pack; compute waits for that copy, and the storage then lives only as
  long as the forward itself uses it (``natural_free``);
* **back one storage ahead**: in backward, a storage's first unpack loads it
  (if it is not already loaded) and starts loading the next one in the
  unit's reload order (saved last, first), so one reload overlaps the
  backward in between; a reload buffer lives until its saved tensors are
  released.

Only ``Offload`` units stream; a plan's ``RecomputeOffload`` units keep the
grouped rules among themselves (:func:`whole_effect` combines the two).

Example:
    >>> effect = stream_effect(prof, plan, OffloadOptions(stream=True))
    >>> effect.host_bytes
"""

from __future__ import annotations

from dataclasses import dataclass

from gradckpt.engine.decisions import Offload, RecomputeOffload
from gradckpt.planning.handlers.effects import Buffer, StepEffect, combined
from gradckpt.planning.kinds.offload.cost import (
    Issue,
    Wait,
    transfer_seconds,
)
from gradckpt.planning.kinds.offload.sim import (
    moved_storages,
    offload_effect,
    play,
    step_effect,
)
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan, UnitChoice
from gradckpt.profiling.records import NEVER, PackRecord, Profile, UnitRecord

__all__ = [
    "StreamedStorage", "describe_streamed", "stream_effect", "streamed_storages", "whole_effect",
]


@dataclass(frozen=True)
class StreamedStorage:
    """One storage a streamed unit moves, in profile positions."""

    path: str
    storage: int
    nbytes: int
    out: int  # its first pack: copied out here, compute waits
    load: int  # its reload starts here
    need: int  # its first unpack
    release: int  # its last saved tensor is released: the reload buffer goes
    #: The unit's output, saved inside it: copied at its save like the others (the
    #: engine learns what the output is only when the forward returns), then dropped
    #: from the host there (``release``: the unit's last op), never loaded.
    output: bool = False


def streamed_storages(profile: Profile, plan: Plan, options: OffloadOptions) -> list[StreamedStorage]:
    """Every storage the plan's top-level ``Offload`` units stream, with its positions.

    Example:
        >>> [s.nbytes for s in streamed_storages(prof, plan, OffloadOptions(stream=True))]
    """
    by_path = {u.path: u for u in profile.units}
    chosen = [
        by_path[item.path] for item in plan.items
        if isinstance(item, UnitChoice) and isinstance(item.decision, Offload)
        and item.path in by_path
    ]  # fmt: skip
    packs_of: dict[int, list[PackRecord]] = {u.index: [] for u in chosen}
    for p in profile.packs:  # one pass: deep chains stream hundreds of units
        if p.unit in packs_of:
            packs_of[p.unit].append(p)
    out: list[StreamedStorage] = []
    for unit in chosen:
        sids = set(moved_storages(profile, unit, options.min_bytes))
        packs = [p for p in packs_of[unit.index] if p.storage in sids]
        first_pack = {s: min(p.position for p in packs if p.storage == s) for s in sids}
        last_pack = {s: max(p.position for p in packs if p.storage == s) for s in sids}
        need = {s: min(p.unpack for p in packs if p.storage == s) for s in sids}
        release = {s: max(p.release for p in packs if p.storage == s) for s in sids}
        order = sorted(sids, key=lambda s: -last_pack[s])  # the engine's reload order
        loaded: dict[int, int] = {}
        for s in sorted(sids, key=lambda s: need[s]):
            at = need[s]
            loaded.setdefault(s, at)
            after = order[order.index(s) + 1 :]
            nxt = next((t for t in after if t not in loaded), None)
            if nxt is not None and options.prefetch:
                loaded[nxt] = at
        out += [
            StreamedStorage(unit.path, s, profile.storages[s].nbytes, first_pack[s], loaded[s],
                            need[s], release[s])
            for s in order
        ]  # fmt: skip
        saved_output = [p.position for p in packs_of[unit.index] if p.storage == unit.output]
        if saved_output and _copied(profile, unit.output, unit, options):
            # The forward ends after its last op and its last save (saves follow their op).
            mine = packs_of[unit.index]
            close = max(profile.ops[unit.end_op - 1].position, *(p.position for p in mine))
            out.append(StreamedStorage(unit.path, unit.output,
                                       profile.storages[unit.output].nbytes, min(saved_output),
                                       NEVER, NEVER, close, output=True))  # fmt: skip
    return out


def _copied(profile: Profile, sid: int, unit: UnitRecord, options: OffloadOptions) -> bool:
    """Whether the engine copies storage ``sid`` when ``unit`` saves it (its own, big enough)."""
    storage = profile.storages[sid]
    return unit.first_op <= storage.producer < unit.end_op and storage.nbytes >= options.min_bytes


def stream_effect(profile: Profile, plan: Plan, options: OffloadOptions) -> StepEffect | None:
    """The streamed units' effect on the step: saved tensors that no longer hold their
    storage, the reload buffers, the host bytes and the copies' stall.

    Example:
        >>> stream_effect(prof, plan, OffloadOptions(stream=True)).buffers
    """
    moved = streamed_storages(profile, plan, options)
    if not moved:
        return None
    units = {u.path: u.index for u in profile.units}
    keys = {(units[m.path], m.storage) for m in moved if not m.output}
    released = frozenset(p.id for p in profile.packs if (p.unit, p.storage) in keys)
    buffers = tuple(Buffer(m.nbytes, m.load, m.release) for m in moved if not m.output)
    return StepEffect(
        released_packs=released,
        buffers=buffers,
        stall=sum(_stalls(profile, moved, options).values()),
        host_bytes=_host_peak(moved),
    )


def _host_peak(moved: list[StreamedStorage]) -> int:
    """The most bytes on the host at once: every moved storage from its copy on, and an
    output copy until its unit's forward ends."""
    changes = [(m.out, 0, m.nbytes) for m in moved]
    # An output saved by its unit's last op is dropped after that op: after its copy.
    changes += [(m.release, 1, -m.nbytes) for m in moved if m.output]
    held = peak = 0
    for _, _, delta in sorted(changes):
        held += delta
        peak = max(peak, held)
    return peak


def _stalls(
    profile: Profile, moved: list[StreamedStorage], options: OffloadOptions
) -> dict[str, float]:
    """Seconds compute waits per streamed unit: every copy out in full, each copy back for
    what the backward between its load and its use does not cover."""
    events: list[tuple[int, int, object]] = []
    for i, m in enumerate(moved):
        d2h = transfer_seconds(m.nbytes, 1, options.d2h_bandwidth, options.transfer_latency)
        h2d = transfer_seconds(m.nbytes, 1, options.h2d_bandwidth, options.transfer_latency)
        events += [(m.out, 0, Issue(("out", i), d2h)), (m.out, 1, Wait(("out", i)))]
        if not m.output:
            events += [(m.load, 2, Issue(("in", i), h2d)), (m.need, 3, Wait(("in", i)))]
    by_unit: dict[str, float] = {m.path: 0.0 for m in moved}
    for (_, i), late in play(profile, events).waits.items():
        by_unit[moved[i].path] += late
    return by_unit


def describe_streamed(profile: Profile, plan: Plan) -> dict[str, str]:
    """Per streamed unit: what moves and what its copies cost (for ``explain``).

    Example:
        >>> describe_streamed(prof, plan)["blocks.0"]
    """
    options = plan.offload or OffloadOptions()
    if not options.stream:
        return {}
    moved = streamed_storages(profile, plan, options)
    stalls = _stalls(profile, moved, options)
    out = {}
    for path, stall in stalls.items():
        mine = [m for m in moved if m.path == path and not m.output]
        out[path] = (
            f"offload {sum(m.nbytes for m in mine) / 2**20:.2f} MiB streamed: {len(mine)} "
            f"tensors, each out when saved, back one ahead of its use, waits {stall * 1e3:.2f} ms"
        )
    return out


def whole_effect(profile: Profile, plan: Plan) -> StepEffect | None:
    """The plan's offload as the simulator applies it: grouped units and moved inputs by
    :mod:`~gradckpt.planning.kinds.offload.sim`, streamed units by :func:`stream_effect`.

    Example:
        >>> whole_effect(prof, plan).host_bytes
    """
    options = plan.offload or OffloadOptions()
    top = [i.decision for i in plan.items if isinstance(i, UnitChoice)]
    grouped = any(
        isinstance(d, RecomputeOffload) or (isinstance(d, Offload) and not options.stream)
        for d in top
    )
    effects = []
    if grouped:
        effects.append(step_effect(profile, offload_effect(profile, plan, options)))
    if options.stream:
        effects.append(stream_effect(profile, plan, options))
    return combined(e for e in effects if e is not None)
