"""Learning the call shape of a plan applied alone, from its units' input shapes.

A plan records the input shape of each unit, not the model call's shape key.
When a guard does not know its plan's key (``apply(model, plan)``, a
single-plan file loaded as a set), each new key's call is checked by the
plan's units: the first call whose units all get their planned shapes teaches
the guard the plan's key; a call where one does not is warned about (or
refused, under ``"error"``) once for its key, by the guard, not once per unit.

Example:
    >>> entry = start(guard, key)  # the root wrapper, before the model's forward
    >>> learning().unit_called("blocks.0", (256, 64), (384, 64))  # a unit's wrapper
    >>> finish(entry, completed=True)  # the root wrapper, after it
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradckpt.planning.plans.call_key import ShapeKey

if TYPE_CHECKING:
    from gradckpt.apply.guard_routing import ShapeGuard

__all__ = ["Learning", "finish", "learning", "start"]


@dataclass(eq=False)
class Learning:
    """A guarded call at a key not yet known to fit the plan: its units check their inputs."""

    guard: ShapeGuard
    key: ShapeKey
    seen: set[str] = field(default_factory=set)
    mismatched: bool = False

    def unit_called(self, path: str, planned: tuple[int, ...], got: tuple[int, ...]) -> None:
        """A unit's call in this model call, with the shape of its first tensor input.

        Only a unit's first call counts (a unit called again may take other shapes).
        """
        if path in self.seen or self.mismatched:
            return
        self.seen.add(path)
        if got != planned:
            self.mismatched = True
            self.guard.unit_mismatch(self.key, path, planned, got)


_THREAD = threading.local()


def _stack() -> list[Learning]:
    stack = getattr(_THREAD, "learning", None)
    if stack is None:
        stack = _THREAD.learning = []
    return stack


def start(guard: ShapeGuard, key: ShapeKey) -> Learning:
    """Open the record of a call at ``key`` that the plan's units check."""
    entry = Learning(guard, key)
    _stack().append(entry)
    return entry


def learning() -> Learning | None:
    """The innermost guarded call on this thread whose key its units check, or None."""
    stack = getattr(_THREAD, "learning", None)
    return stack[-1] if stack else None


def finish(entry: Learning, completed: bool) -> None:
    """Close ``entry`` (the root wrapper, when the call ends): a call that completed with
    no unit off its planned shape teaches the guard the plan's key."""
    stack = _stack()
    if entry in stack:
        stack.remove(entry)
    if completed and not entry.mismatched:
        entry.guard.learned(entry.key)
