"""``Recompute``: the unit is a checkpointed region that keeps only its inputs."""

from __future__ import annotations

from typing import Any

from gradckpt.engine.checkpoint import run_checkpointed
from gradckpt.engine.decisions import RECOMPUTE, Decision, Recompute
from gradckpt.planning.handlers.engine_counts import EngineCounts
from gradckpt.planning.handlers.lookup import Lookup, recompute_end
from gradckpt.planning.handlers.region import Region
from gradckpt.planning.handlers.registry import KindHandler, register
from gradckpt.planning.simulation.costs import region_counts
from gradckpt.profiling.records import Profile, UnitRecord

__all__ = ["RecomputeHandler"]


class RecomputeHandler(KindHandler):
    """A region over the unit: its ops run again in backward, up to its last saved tensor.

    The base of every kind that opens a region; such a kind overrides
    :meth:`kept_ops` (ops whose outputs the region keeps) and :meth:`policy`.
    """

    decision = Recompute
    opens_region = True
    #: True if the region's forward shows every op to a per-op policy (an engine cost).
    asks_policy = False

    def kept_ops(self, unit: UnitRecord, decision: Decision) -> frozenset[int]:
        """Global indexes of the unit's ops whose outputs the region keeps (not rerun)."""
        return frozenset()

    def stage_options(self, profile: Profile, unit: UnitRecord, look: Lookup) -> list[Decision]:
        return [RECOMPUTE]

    def kept_storages(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> set[int]:
        return {s for i in self.kept_ops(unit, decision) for s in profile.ops[i].outputs}

    def recompute_seconds(
        self, profile: Profile, unit: UnitRecord, decision: Decision, look: Lookup
    ) -> float:
        cached = self.kept_ops(unit, decision)
        stop = recompute_end(profile, unit, look)
        return sum(op.time for op in profile.ops[unit.first_op : stop] if op.index not in cached)

    def engine_counts(self, profile: Profile, unit: UnitRecord, decision: Decision) -> EngineCounts:
        return region_counts(profile, unit, policy=self.asks_policy)

    def region(self, profile: Profile, unit: UnitRecord, decision: Decision) -> Region | None:
        return Region(
            [unit.index], unit.first_op, unit.end_op, self.kept_ops(unit, decision),
            frozenset(unit.inputs),
        )  # fmt: skip

    def run(self, unit: Any, args: tuple, kwargs: dict, *, in_recompute: bool) -> Any:
        if unit.body is not None:
            return run_checkpointed(
                unit.body, args, kwargs, name=unit.path, compiled=True, state=unit.modules
            )
        return run_checkpointed(unit.plain, args, kwargs, policy=unit.policy, name=unit.path)


register(RecomputeHandler())
