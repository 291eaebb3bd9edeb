"""``Offload``: the unit runs plainly; what it saves goes to host memory and comes back.

In the planner (only when the chain is built with offload options,
``build_chain(profile, settings={Offload: OffloadOptions(...)})``): blocks offer an ``Offload`` option that
holds on the device what it does not move (:func:`moved_storages`: what the
unit made itself, not its output, at least ``min_bytes``), and whose time adds
the copies' stall with the next unit's compute as overlap windows
(:func:`stage_stall`); never inside a segment's recompute. Its plan-wide
effect in the simulator (stash, prefetched reload buffers, copy queue;
:meth:`OffloadHandler.plan_effect`) is :mod:`gradckpt.planning.kinds.offload.sim`; at run time one
:class:`~gradckpt.engine.offload.runtime.OffloadRuntime` per applied plan
orders the copies of all offloaded units (:mod:`gradckpt.engine.offload`).
"""

from __future__ import annotations

from typing import Any

from gradckpt.engine.decisions import Decision, Offload
from gradckpt.engine.offload.runtime import OffloadRuntime
from gradckpt.planning.handlers.effects import StepEffect
from gradckpt.planning.handlers.lookup import Lookup
from gradckpt.planning.handlers.registry import register
from gradckpt.planning.kinds.keep import KeepHandler
from gradckpt.planning.kinds.offload.sim import moved_storages, stage_stall
from gradckpt.planning.kinds.offload.stream import whole_effect
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan, UnitChoice
from gradckpt.profiling.records import Profile, UnitRecord

__all__ = ["OFFLOAD", "OffloadHandler"]

OFFLOAD = Offload()


class OffloadHandler(KeepHandler):
    """No region; the saved tensors it moves are off the device between forward and backward."""

    decision = Offload
    nested = False  # rerun inside a segment's recompute, it runs as Keep (see run)

    def stage_options(self, profile: Profile, unit: UnitRecord, look: Lookup) -> list[Decision]:
        return [OFFLOAD] if look.settings.get(Offload) is not None and unit.is_block else []

    def kept_storages(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> set[int]:
        kept = super().kept_storages(profile, unit, decision, look)
        min_bytes = (look.settings.get(Offload) or OffloadOptions()).min_bytes
        return kept - set(moved_storages(profile, unit, min_bytes))

    def recompute_seconds(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> float:
        """Not recompute: the seconds compute waits for this unit's copies (the DP's estimate)."""
        options = look.settings.get(Offload) or OffloadOptions()
        index = next((i for i, u in enumerate(look.units) if u.index == unit.index), None)
        if index is None:
            return 0.0
        moved = moved_storages(profile, unit, options.min_bytes)
        return stage_stall(profile, look.units, index, moved, options)

    def plan_effect(self, profile: Profile, plan: Plan) -> StepEffect | None:
        """The stash, reload buffers and copy stalls of the plan's top-level offloaded units
        (nested ones run as Keep)."""
        top = (i.decision for i in plan.items if isinstance(i, UnitChoice))
        if not any(isinstance(decision, Offload) for decision in top):
            return None
        return whole_effect(profile, plan)

    def install(self, plan: Any) -> OffloadRuntime:
        options = getattr(plan, "offload", None) or OffloadOptions()
        return OffloadRuntime(options.min_bytes, options.prefetch, options.host_budget, options.stream)

    def run(self, unit: Any, args: tuple, kwargs: dict, *, in_recompute: bool) -> Any:
        if in_recompute or unit.runtime is None or unit.segments:
            # Inside a segment (its forward or its recompute) a unit runs as Keep: the
            # segment's region keeps only its input anyway.
            return super().run(unit, args, kwargs, in_recompute=in_recompute)
        return unit.runtime.run(unit, args, kwargs)


register(OffloadHandler())
