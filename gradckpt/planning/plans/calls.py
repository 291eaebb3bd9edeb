"""A plan as the engine runs it on a step that calls its modules another number of times.

A plan's units are calls: a module the step calls twice has units ``path#0`` and
``path#1``. When a step calls the model more (or fewer) times than the plan was
made for, the engine still runs every call: a module planned for one call per
step runs that unit's decision at each call; one planned for ``n`` calls runs
call ``k`` as unit ``k mod n`` (:class:`gradckpt.apply.calls.CallClock`).
:func:`as_called` writes that down as a plan for the step's own units, so the
simulator can say what such a step peaks at.

Example:
    >>> as_called(plan_for_one_call, ["blocks.0#0", "blocks.0#1"]).items
    (UnitChoice('blocks.0#0', Recompute()), UnitChoice('blocks.0#1', Recompute()))
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from gradckpt.planning.plans.plan import Plan, Segment, UnitChoice
from gradckpt.profiling.units import CALL_MARK, module_path

__all__ = ["as_called"]


def _call_index(unit_path: str) -> int:
    _, mark, number = unit_path.partition(CALL_MARK)
    return int(number) if mark else 0


def as_called(plan: Plan, unit_paths: list[str]) -> Plan | None:
    """``plan`` as the engine runs it on a step whose units are ``unit_paths``.

    None for a plan with segments (a segment's recompute replays a fixed run of
    calls; at another number of calls that run is not this plan's). A unit of
    a module the plan does not name is kept.
    """
    if any(isinstance(item, Segment) for item in plan.items):
        return None
    if [c.path for c in plan.items] == list(unit_paths):
        return plan
    by_module: dict[str, list[UnitChoice]] = defaultdict(list)
    for choice in sorted(plan.items, key=lambda c: _call_index(c.path)):  # type: ignore[union-attr]
        by_module[module_path(choice.path)].append(choice)  # type: ignore[union-attr]
    items = []
    for path in unit_paths:
        choices = by_module.get(module_path(path))
        if not choices:
            items.append(UnitChoice(path))
            continue
        items.append(UnitChoice(path, choices[_call_index(path) % len(choices)].decision))
    return replace(plan, items=tuple(items), input_shapes=())
