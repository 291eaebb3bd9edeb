"""Plan-wide parts beside the units' decisions, and how the simulator reaches them.

A unit's decision reaches the simulator through its kind's handler
(:mod:`.registry`). Some of what a plan does sits beside those decisions: MLPs
run in slices of tokens inside blocks whatever the blocks' decisions
(``Plan.token_chunks``, :mod:`gradckpt.planning.kinds.chunk.token_plan`). Such a
part registers a :class:`PlanPart`; the simulator and its regions ask every
registered part, so they import nothing above themselves.

Example:
    >>> for part in plan_parts():
    ...     tops = part.regions(profile, plan, tops)
"""

from __future__ import annotations

from typing import Any

from gradckpt.planning.handlers.effects import StepEffect
from gradckpt.planning.handlers.region import Region

__all__ = ["PlanPart", "plan_parts", "register_part"]


class PlanPart:
    """What a plan-wide part does to the simulated step (nothing, by default)."""

    def regions(self, profile: Any, plan: Any, tops: list[Region]) -> list[Region]:
        """``tops`` (the plan's top regions, packs assigned) with this part's regions added."""
        return tops

    def effect(self, profile: Any, plan: Any) -> StepEffect | None:
        """The part's plan-wide effect on the step (None: none)."""
        return None


_PARTS: dict[str, PlanPart] = {}


def register_part(name: str, part: PlanPart) -> PlanPart:
    """Register ``part`` under ``name`` (again: replaced).

    Example:
        >>> register_part("token_chunks", TokenChunkPart())
    """
    _PARTS[name] = part
    return part


def plan_parts() -> list[PlanPart]:
    """The registered parts, in registration order."""
    return list(_PARTS.values())
