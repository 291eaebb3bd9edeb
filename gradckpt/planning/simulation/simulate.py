"""``simulate(profile, plan)``: predict a plan's peak bytes and step time from liveness.

The plain step's event line (from the profile) is edited the way the engine
would run the plan:

* in the forward, a storage saved only inside a region dies when the forward no
  longer needs it (its "natural" free); region inputs and the outputs a
  selective region keeps live until the region's last saved tensor is
  released;
* at a region's first unpack in backward its ops run again up to its last save
  (early stop): recomputed storages are allocated there and live until backward
  releases them, or until the end of the recompute if nothing saved them;
* inside a segment's recompute, nested regions keep their inputs (and kept
  outputs) until their own recompute, which happens at their first unpack.

A kind whose units act on the plan as a whole (``Offload``'s stash and copy
queue) hands the simulator a :class:`~gradckpt.planning.handlers.effects.StepEffect`
(its handler's ``plan_effect``): saved tensors that stop holding their storage,
storages kept live until a position, region inputs its units no longer hold, buffers
it adds, and seconds compute waits.

Everything else (backward allocations, gradients, storages the plain step
keeps) stays where the profile measured it.

Each op's workspace (what its kernel allocated beyond its outputs, measured at
the allocator) is added at the op's position for the length of the op: in the
forward, in backward, and again wherever a recompute runs the op. On a CUDA
profile every storage is counted as the caching allocator's block (rounded up
to 512 bytes). So the prediction is of the allocator's peak; tests hold it to
2% of the measured one (median over models) and 5% at worst.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from gradckpt.measure.allocator import allocator_block_bytes
from gradckpt.planning.handlers.effects import StepEffect, combined
from gradckpt.planning.handlers.engine_counts import EngineCounts
from gradckpt.planning.handlers.plan_parts import plan_parts
from gradckpt.planning.handlers.region import Region
from gradckpt.planning.handlers.registry import handler_for
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.simulation.costs import engine_seconds, plan_counts, step_costs
from gradckpt.planning.simulation.event_line import (
    EventLine,
    Position,
    Workspace,
    plain_at,
    shared_events,
)
from gradckpt.planning.simulation.regions import regions_of
from gradckpt.profiling.records import NEVER, Profile

__all__ = ["Prediction", "Recomputed", "live_trace", "region_state_bytes", "simulate"]


@dataclass(frozen=True)
class Prediction:
    """What a plan is predicted to cost."""

    peak_bytes: int
    step_time: float
    overhead: float
    recompute_time: float
    recompute_flops: int
    peak_position: int
    #: Seconds recomputed per unit index (-1: ops outside every unit).
    recompute_by_unit: dict[int, float] = field(default_factory=dict)
    #: Workspace of the op running at the peak (0: the peak is tensors only).
    peak_workspace_bytes: int = 0
    #: Index of the op whose workspace is part of the peak (-1: none).
    peak_workspace_op: int = -1
    #: Seconds of the engine's own work (dispatch modes, hooks, regions); in step_time.
    engine_time: float = 0.0
    #: The engine events that ``engine_time`` prices.
    engine_counts: EngineCounts = field(default_factory=EngineCounts)
    #: Seconds compute waits for plan-wide effects (offload's copies on the simulated
    #: link); in step_time.
    offload_stall: float = 0.0
    #: Bytes the plan's effects hold in host memory at once (offloaded units, at the end
    #: of forward).
    host_bytes: int = 0
    #: The forward/backward phase's peak; ``peak_bytes`` is the larger of it and the
    #: profile's ``floor_bytes`` (the optimizer step's peak, when the step is counted).
    fwd_bwd_peak_bytes: int = 0


class Recomputed(NamedTuple):
    """A region the simulator recomputed and the op index its recompute stops at."""

    region: Region
    stop: int


# A storage a recompute makes again is a list [nbytes, alloc, free] (mutable: its free
# moves later as saved tensors and nested regions hold it; a slotted object there cost
# a tenth of a simulation, measured).
_FREE = 2


@functools.cache
def _cpu_rng_bytes() -> int:
    # The engine keeps a copy of the CPU generator's state per region (to replay
    # dropout) and takes two more while it recomputes; on a CPU step those
    # copies come from the same allocator as the activations.
    return torch.get_rng_state().untyped_storage().nbytes()


def region_state_bytes(profile: Profile) -> int:
    """Bytes each checkpointed region keeps from its forward to its backward besides
    tensors: the CPU RNG state on a CPU step (0 on CUDA, where it is not device memory).

    Example:
        >>> region_state_bytes(prof)  # 5056 on a CPU profile with torch's default generator
    """
    return _cpu_rng_bytes() if profile.device == "cpu" else 0


class _Simulator:
    def __init__(
        self, profile: Profile, regions: list[Region], effect: StepEffect | None = None
    ) -> None:
        self.p = profile
        self.regions = regions
        self.effect = effect
        self.shared = shared_events(profile)
        self.line = EventLine(cuda=profile.device == "cuda", static=self.shared.static)
        # Storage sizes as the plan makes them (a chunked region's are one slice's).
        self.resized = effect.resized if effect is not None else {}
        self.nbytes = self.shared.nbytes
        if self.resized:
            self.nbytes = list(self.nbytes)
            for sid, n in self.resized.items():
                self.nbytes[sid] = allocator_block_bytes(n) if self.line.cuda else n
        self.rng_bytes = region_state_bytes(profile)
        self.recompute_time = 0.0
        self.recompute_by_unit: dict[int, float] = {}
        self.recompute_flops = 0
        self.recomputed: list[Recomputed] = []  # for the engine costs

    def death(self, region: Region) -> int:
        releases = [self.p.packs[i].release for i in region.packs]
        if not releases:
            return self.p.ops[region.end_op - 1].position + 1
        return max(releases)

    def first_unpack(self, region: Region) -> int:
        return min((self.p.packs[i].unpack for i in region.packs), default=NEVER)

    def run(self) -> None:
        p = self.p
        top_of_pack: dict[int, Region] = {}
        for region in self.regions:
            for pid in region.packs:
                top_of_pack[pid] = region
        held_until: dict[int, int] = {}
        # Inputs a unit's own region no longer holds (the effect moved them to host).
        moved_inputs = self.effect.released_inputs if self.effect is not None else frozenset()
        for region in self.regions:
            death = self.death(region)
            for sid in region.inputs:
                if len(region.units) == 1 and (region.units[0], sid) in moved_inputs:
                    continue
                held_until[sid] = max(held_until.get(sid, 0), death)
            for op in region.save:
                for sid in p.ops[op].outputs:
                    held_until[sid] = max(held_until.get(sid, 0), death)
        # Forward storages (those allocated in backward are in the shared events).
        # This loop and recompute's run once per simulated plan: written for speed.
        # The plan-wide effect's released saved tensors do not hold their storage;
        # its own holds (a stash) do.
        events, packs, effect = self.line.events, p.packs, self.effect
        released = effect.released_packs if effect is not None else frozenset()
        live_until = effect.live_until if effect is not None else None
        resized, sizes = self.resized, self.nbytes
        for sid, nbytes, alloc, free, pids in self.shared.forward:
            if resized and sid in resized:
                nbytes = sizes[sid]
            for pid in pids:
                if pid not in top_of_pack and packs[pid].release > free and pid not in released:
                    free = packs[pid].release
            held = held_until.get(sid, 0)
            if held > free:
                free = held
            if live_until and live_until.get(sid, 0) > free:
                free = live_until[sid]
            events.append((alloc, -nbytes))
            if free < NEVER:
                events.append(((free, 1, 0, 0.0), nbytes))
        for buffer in effect.buffers if effect is not None else ():
            self.line.add(buffer.nbytes, plain_at(buffer.alloc), plain_at(buffer.free))
        self.shrink_backward()
        for region in self.regions:
            if self.rng_bytes:  # each entry of the region keeps one
                opened = plain_at(p.ops[region.first_op].position - 1)
                self.line.add(self.rng_bytes * region.repeats, opened, plain_at(self.death(region)))
            start = self.first_unpack(region)
            if start < NEVER:
                self.recompute(region, start, 0, {})

    def shrink_backward(self) -> None:
        """Resize storages made in backward, whose whole sizes are in the shared events:
        the difference leaves just before each is made and comes back just after it dies
        (never a moment above the resized level)."""
        p, events = self.p, self.line.events
        for sid in self.resized:
            s = p.storages[sid]
            if s.producer < p.forward_ops:
                continue  # a forward storage: sized where the forward loop reads it
            less = self.shared.nbytes[sid] - self.nbytes[sid]
            events.append(((s.alloc, 1, 0, -0.5), less))
            if s.free < NEVER:
                events.append(((s.free, 1, 0, 0.5), -less))

    @staticmethod
    def _deferred_chunk(region: Region, stop: int) -> Region | None:
        """The chunked MLP holding this recompute's last saved tensor, if one does: the
        recompute opens its slices' regions without running them and stops there
        (:mod:`gradckpt.engine.chunking.slices`), so it runs only the ops before it."""
        for child in region.children:
            if child.label and child.repeats >= 2 and child.first_op < stop <= child.end_op:
                return child
        return None

    def recompute(self, region: Region, start: int, depth: int, outer: dict[int, list]) -> None:
        if not region.reruns:  # its backward's work was done in the forward (the effect's)
            return
        p = self.p
        stop = max((p.packs[i].ops_done for i in region.packs), default=region.first_op)
        stop = min(stop, region.end_op)
        deferred = self._deferred_chunk(region, stop)
        if deferred is not None:
            stop = deferred.first_op
        self.recomputed.append(Recomputed(region, stop))
        child_of: dict[int, Region] = {}
        for child in region.children:
            for pid in child.packs:
                child_of[pid] = child
        copies: dict[int, list] = {}  # storage id -> [nbytes, alloc, free]
        here = lambda q: (start - 1, 0, depth, float(q))  # noqa: E731 - a Position at offset q
        first, base = region.first_op, start - 1
        end = here(stop - first + 0.5)
        if self.rng_bytes:  # the RNG states the replay saves and sets, for its length
            self.line.add(2 * self.rng_bytes, here(-1), end)
        ops, save, nbytes, natural = p.ops, region.save, self.nbytes, self.shared.natural_op
        by_unit, time, flops = self.recompute_by_unit, self.recompute_time, self.recompute_flops
        for k in range(first, stop):
            if k in save:
                continue
            op = ops[k]
            time += op.time
            by_unit[op.unit] = by_unit.get(op.unit, 0.0) + op.time
            flops += op.flops
            at = (base, 0, depth, float(k - first))
            if op.workspace > 0:
                self.line.transient(op.workspace, at, op.index)
            for sid in op.outputs:
                done = natural[sid]
                free = (base, 0, depth, float(done - first - 0.5)) if done < stop else end
                copies[sid] = [nbytes[sid], at, free]
        self.recompute_time, self.recompute_flops = time, flops
        visible = {**outer, **copies}
        packs = p.packs
        for pid in region.packs:
            if pid in child_of:
                continue
            entry = visible.get(packs[pid].storage)
            if entry is not None:
                released = (packs[pid].release, 1, 0, 0.0)
                if released > entry[_FREE]:
                    entry[_FREE] = released
        for child in region.children:
            child_start = self.first_unpack(child)
            if child_start >= NEVER:
                continue
            child_end = (child_start - 1, 0, depth + 1, float(child.end_op - child.first_op + 1))
            if self.rng_bytes:  # the child's frame, made by this recompute, keeps its RNG state
                made = here(child.first_op - region.first_op - 0.5)
                self.line.add(self.rng_bytes, made, plain_at(self.death(child)))
            kept = set(child.inputs) | {s for op in child.save for s in p.ops[op].outputs}
            for sid in kept:
                if sid in visible:
                    visible[sid][_FREE] = max(visible[sid][_FREE], child_end)
            self.recompute(child, child_start, depth + 1, visible)
        events = self.line.events  # sizes in copies are already as the line counts them
        for size, alloc, free in copies.values():
            events.append((alloc, -size))
            if free[0] < NEVER:  # its step
                events.append((free, size))


def simulate(profile: Profile, plan: Plan) -> Prediction:
    """Predict the peak bytes and step time of ``plan`` on the profiled step.

    Example:
        >>> pred = simulate(prof, plan)
        >>> pred.peak_bytes, pred.overhead
    """
    effect = _plan_effect(profile, plan)
    sim = _Simulator(profile, regions_of(profile, plan), effect)
    sim.run()
    positions, lives = sim.line.trace()
    peak = max(lives, default=0)
    where = positions[lives.index(peak)] if lives else plain_at(0)  # the first at the peak
    workspace, op = sim.line.workspace_of.get(where, Workspace(0, -1))
    # The engine's own costs (issue #16): measured per event, counted per plan.
    counts = plan_counts(profile, sim.regions, sim.recomputed)
    engine = engine_seconds(counts, step_costs(profile))
    stall = effect.stall if effect is not None else 0.0
    step_time = profile.step_time + sim.recompute_time + engine + stall
    fwd_bwd = profile.param_bytes + profile.resident_bytes + peak
    return Prediction(
        # The optimizer step's peak (the floor) no plan lowers; it can be the step's peak.
        peak_bytes=max(fwd_bwd, profile.floor_bytes),
        fwd_bwd_peak_bytes=fwd_bwd,
        step_time=step_time,
        overhead=step_time / profile.step_time - 1.0 if profile.step_time > 0 else 0.0,
        recompute_time=sim.recompute_time,
        recompute_by_unit=sim.recompute_by_unit,
        recompute_flops=sim.recompute_flops,
        peak_position=int(Position._make(where).step),
        peak_workspace_bytes=workspace,
        peak_workspace_op=op,
        engine_time=engine,
        engine_counts=counts,
        offload_stall=stall,
        host_bytes=effect.host_bytes if effect is not None else 0,
    )


def _plan_effect(profile: Profile, plan: Plan) -> StepEffect | None:
    """The plan-wide effects of the kinds the plan uses, as one (None: none has any)."""
    kinds = dict.fromkeys(type(u.decision) for u in plan.units)  # in plan order
    effects = [handler_for(kind).plan_effect(profile, plan) for kind in kinds]
    # Parts beside the units' decisions (MLPs in slices of tokens).
    effects += [part.effect(profile, plan) for part in plan_parts()]
    return combined(e for e in effects if e is not None)


def live_trace(profile: Profile, plan: Plan) -> tuple[list[int], list[int], float]:
    """Event positions (plain-step coordinates, recompute events just before their
    trigger) and live created bytes after each event, plus the recompute time."""
    sim = _Simulator(profile, regions_of(profile, plan), _plan_effect(profile, plan))
    sim.run()
    positions, lives = sim.line.trace()
    return [p[0] for p in positions], lives, sim.recompute_time  # each Position's step
