"""``Keep``: the unit runs plainly and autograd keeps everything it saves."""

from __future__ import annotations

from typing import Any

from gradckpt.engine.decisions import KEEP, Decision, Keep
from gradckpt.planning.handlers.lookup import Lookup
from gradckpt.planning.handlers.registry import KindHandler, register
from gradckpt.profiling.records import Profile, UnitRecord

__all__ = ["KeepHandler"]


class KeepHandler(KindHandler):
    """No region: the unit holds every tensor its forward saves until its backward."""

    decision = Keep

    def stage_options(self, profile: Profile, unit: UnitRecord, look: Lookup) -> list[Decision]:
        return [KEEP]

    def kept_storages(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> set[int]:
        inside = range(unit.first_op, unit.end_op)
        return {
            p.storage for p in look.packs.get(unit.index, ())
            if p.storage >= 0 and profile.storages[p.storage].producer in inside
        }  # fmt: skip

    def run(self, unit: Any, args: tuple, kwargs: dict, *, in_recompute: bool) -> Any:
        if in_recompute:
            # A segment's recompute: run as its forward ran this unit.
            return unit.call_in_region(args, kwargs)
        return (unit.body or unit.plain)(*args, **kwargs)


register(KeepHandler())
