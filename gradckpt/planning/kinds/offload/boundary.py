"""``RecomputeOffload``: a recomputed unit whose kept input goes to host memory.

Recomputing a block frees what it saved but keeps its input for the
recompute; on a chain of recomputed blocks those inputs (the boundaries) are
what the forward leaves on the device, and recompute alone cannot go below
them. This kind is ``Recompute`` with that input offloaded: a region as
``Recompute`` opens, whose input leaves the device when the forward has moved
on and comes back one offloaded unit ahead of the recompute that needs it
(engine: :mod:`gradckpt.engine.offload.boundary`; simulated with the
``Offload`` units by :mod:`gradckpt.planning.kinds.offload.sim`, in one stash
and one copy queue).

In the planner (only with offload options, as ``Offload``) a block offers it
when moving its input frees device memory (:func:`offloadable_boundary`): the
chain counts the input as released between the block's forward and backward
(:meth:`released_input_bytes`), its time is the recompute's plus the copies'
stall, and it is never chosen inside a segment's recompute.

Example:
    >>> build_chain(prof, settings={Offload: OffloadOptions()}).options[3]
    (Keep(), Recompute(), Offload(), RecomputeOffload(arg=0), ...)
"""

from __future__ import annotations

from typing import Any

from gradckpt.engine.decisions import Decision, Offload, RecomputeOffload
from gradckpt.engine.offload.runtime import OffloadRuntime
from gradckpt.planning.handlers.effects import StepEffect
from gradckpt.planning.handlers.lookup import Lookup
from gradckpt.planning.handlers.registry import register
from gradckpt.planning.kinds.offload.sim import stage_stall
from gradckpt.planning.kinds.offload.stream import whole_effect
from gradckpt.planning.kinds.recompute import RecomputeHandler
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan, UnitChoice
from gradckpt.profiling.records import NEVER, Profile, UnitRecord

__all__ = ["RecomputeOffloadHandler", "offloadable_boundary"]


def offloadable_boundary(profile: Profile, unit: UnitRecord, min_bytes: int) -> int | None:
    """The storage of ``unit``'s input whose move to host would free device memory, or None.

    Its chain input qualifies when it is at least ``min_bytes``, the forward drops
    it (not held to the end, as a returned hidden state would be), and nothing but
    this unit's own region holds it: no saved tensor of another unit or of glue code,
    no other unit's input. Otherwise moving it frees nothing and its copy back would
    be a second device copy.

    Example:
        >>> offloadable_boundary(prof, prof.blocks[1], 4096)  # a storage id, or None
    """
    sid = unit.chain_input
    if sid < 0:
        return None
    storage = profile.storages[sid]
    if storage.nbytes < min_bytes or storage.natural_free == NEVER:
        return None
    if any(p.storage == sid and p.unit != unit.index for p in profile.packs):
        return None
    if any(sid in u.inputs for u in profile.units if u.index != unit.index):
        return None
    return sid


def _options(look: Lookup) -> OffloadOptions:
    return look.settings.get(Offload) or OffloadOptions()


class RecomputeOffloadHandler(RecomputeHandler):
    """A recompute region whose kept input is moved to host memory (see the module docstring)."""

    decision = RecomputeOffload
    nested = False  # inside a segment its input is the segment's business: runs as Recompute
    runtime_group = Offload  # one session with the Offload units: one stash, one copy queue

    def stage_options(self, profile: Profile, unit: UnitRecord, look: Lookup) -> list[Decision]:
        if look.settings.get(Offload) is None or not unit.is_block:
            return []
        if offloadable_boundary(profile, unit, _options(look).min_bytes) is None:
            return []
        return [RecomputeOffload(unit.chain_arg)]

    def option_name(self, decision: Decision, index: int) -> str:
        return "recompute_offload"

    def released_input_bytes(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> int:
        sid = offloadable_boundary(profile, unit, _options(look).min_bytes)
        return profile.storages[sid].nbytes if sid is not None else 0

    def recompute_seconds(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> float:
        """The recompute's seconds plus the DP's estimate of the input's copies' stall."""
        seconds = super().recompute_seconds(profile, unit, decision, look)
        index = next((i for i, u in enumerate(look.units) if u.index == unit.index), None)
        sid = offloadable_boundary(profile, unit, _options(look).min_bytes)
        if index is None or sid is None:
            return seconds
        return seconds + stage_stall(profile, look.units, index, (sid,), _options(look))

    def plan_effect(self, profile: Profile, plan: Plan) -> StepEffect | None:
        """The moved inputs with every other offloaded unit, unless the ``Offload`` kind's
        handler already gives that effect (a plan with top-level ``offload`` items)."""
        top = [i.decision for i in plan.items if isinstance(i, UnitChoice)]
        if any(isinstance(d, Offload) for d in top):
            return None
        if not any(isinstance(d, RecomputeOffload) for d in top):
            return None  # nested ones run as Recompute
        return whole_effect(profile, plan)

    def install(self, plan: Any) -> OffloadRuntime:
        options = getattr(plan, "offload", None) or OffloadOptions()
        return OffloadRuntime(options.min_bytes, options.prefetch, options.host_budget, options.stream)

    def run(self, unit: Any, args: tuple, kwargs: dict, *, in_recompute: bool) -> Any:
        region = super().run
        if in_recompute or unit.runtime is None or unit.segments:
            return region(unit, args, kwargs, in_recompute=in_recompute)
        return unit.runtime.run_boundary(
            unit, args, kwargs, unit.decision.arg,
            lambda: region(unit, args, kwargs, in_recompute=False),
        )  # fmt: skip

    def describe(self, decision: Decision) -> str:
        return "recompute  input to host after its forward, back before its recompute"

    def explain(self, decision: Decision) -> str:
        return "recompute, input offloaded"


register(RecomputeOffloadHandler())
