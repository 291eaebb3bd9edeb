"""How many engine events one step of a plan has: what a kind's units count.

A kind's handler counts its unit's events
(:meth:`KindHandler.engine_counts <gradckpt.planning.handlers.registry.KindHandler.engine_counts>`);
the cost model (:mod:`gradckpt.planning.simulation.costs`) prices them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineCounts"]


@dataclass(frozen=True)
class EngineCounts:
    """How many times each engine event happens in one step of a plan.

    Example:
        >>> engine_seconds(EngineCounts(regions=2, recompute_ops=40), costs)
    """

    regions: int = 0
    recompute_ops: int = 0  # every op a recompute runs (or replays), up to its early stop
    policy_ops: int = 0
    saved_tensors: int = 0
    #: Of ``recompute_ops``, those run under the recompute's dispatch mode (regions that
    #: replay kept outputs); the others run on the saved-tensor hooks alone.
    mode_ops: int = 0
    #: Ops run again per slice beyond the first (forward and backward of a chunked head
    #: or MLP): the kernels' work is the same, the host's per-op cost is paid once more.
    sliced_ops: int = 0

    def __add__(self, other: EngineCounts) -> EngineCounts:
        return EngineCounts(
            self.regions + other.regions,
            self.recompute_ops + other.recompute_ops,
            self.policy_ops + other.policy_ops,
            self.saved_tensors + other.saved_tensors,
            self.mode_ops + other.mode_ops,
            self.sliced_ops + other.sliced_ops,
        )
