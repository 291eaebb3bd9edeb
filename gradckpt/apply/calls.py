"""A module the step calls several times: each call runs as its own unit.

The planner sees every call of a shared module (ALBERT's one layer run at every
depth, the blocks of a model called twice per step) as a unit of its own, named
``path#k`` (:func:`gradckpt.profiling.units.call_path`), and gives each its own
decision: the first calls may be recomputed while the last is kept, or two calls
may share a segment. ``apply`` gives such a module one forward,
:class:`CallsForward`, that hands call ``k`` of the step to the wrapper of unit
``path#k``.

Which call is ``k`` is counted by a :class:`CallClock` shared by the model's
shared modules: it counts the step's forward calls made with grad enabled (a
``no_grad`` evaluation does not count) and starts again when a backward through
the step's first such call finishes. A call the counting gets wrong (a forward
left without backward, a forward that calls the module a different number of
times) runs another call's decision: every decision computes the same gradients,
so only the step's memory and time differ from the plan's, never its results.

A segment's recompute calls its units again during backward; it names the unit
of each call (:func:`replaying`), so the clock does not move then.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from gradckpt.engine import dynamo
from gradckpt.engine.holders import active_frame

__all__ = ["CallClock", "CallsForward", "replaying"]

_REPLAY = threading.local()


@contextlib.contextmanager
def replaying(unit_path: str) -> Iterator[None]:
    """Run the next call of a shared module as unit ``unit_path`` (a segment's replay).

    Example:
        >>> with replaying("encoder.layer#2"):
        ...     module(*args)
    """
    previous = getattr(_REPLAY, "path", None)
    _REPLAY.path = unit_path
    try:
        yield
    finally:
        _REPLAY.path = previous


class CallClock:
    """How many times each shared module has run in the current step, per thread.

    Example:
        >>> clock = CallClock()
        >>> clock.advance("encoder.layer", 4)
        0
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _state(self) -> dict[str, int]:
        counts = getattr(self._local, "counts", None)
        if counts is None:
            counts = self._local.counts = {}
        return counts

    def advance(self, module_path: str, calls: int) -> int:
        """The number of this call of ``module_path`` (0-based, modulo ``calls``)."""
        counts = self._state()
        seen = counts.get(module_path, 0)
        counts[module_path] = seen + 1
        return seen % calls

    def reset(self) -> None:
        """A new step begins: every module's next call is its first."""
        self._state().clear()

    def arm(self, out: Any) -> None:
        """Reset when the backward that reaches ``out`` (a first call's output) finishes.

        Armed at every first call, not once: a forward left without backward (an
        exception) leaves a hook that never fires, and the next step arms again.
        """
        flat, _ = tree_flatten(out)
        first = next(
            (x for x in flat if isinstance(x, torch.Tensor) and x.grad_fn is not None), None
        )
        if first is not None:
            first.register_hook(_ResetAtEnd(self))

    # A copy of the model (deepcopy, pickle) starts counting afresh.
    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._local = threading.local()


class _ResetAtEnd:
    """A gradient hook that resets a clock once the running backward completes."""

    def __init__(self, clock: CallClock) -> None:
        self.clock = clock

    def __call__(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self.clock.reset)


class CallsForward:
    """The ``forward`` of a module called several times per step: call ``k`` runs unit ``k``.

    Holds one unit wrapper per call (``apply.wrappers.UnitForward``), in call order.
    """

    def __init__(self, module_path: str, wrappers: list[Any], clock: CallClock) -> None:
        self.module_path = module_path
        self.wrappers = wrappers
        self.clock = clock
        self.by_path = {w.unit.path: w for w in wrappers}

    @property
    def __gradckpt_original__(self) -> Any:
        return self.wrappers[0].unit.plain

    @property
    def active(self) -> bool:
        return self.wrappers[0].active

    @active.setter
    def active(self, value: bool) -> None:
        for wrapper in self.wrappers:
            wrapper.active = value

    @property
    def root(self) -> Any:
        return self.wrappers[0].root

    @root.setter
    def root(self, guard: Any) -> None:
        for wrapper in self.wrappers:
            wrapper.root = guard

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replayed = getattr(_REPLAY, "path", None)
        if replayed in self.by_path:
            _REPLAY.path = None  # the unit's own calls inside it are not the replayed one
            return self.by_path[replayed](*args, **kwargs)
        if not self.active or not torch.is_grad_enabled():
            return self.wrappers[0](*args, **kwargs)  # runs the module plainly
        if dynamo.is_compiling():
            if all(not (w.unit.handler.opens_region or w.unit.segments) for w in self.wrappers):
                return self.wrappers[0].unit.plain(*args, **kwargs)  # compiles with its caller
            return dynamo.opaque(self._counted)(*args, **kwargs)
        return self._counted(*args, **kwargs)

    def _counted(self, *args: Any, **kwargs: Any) -> Any:
        top = active_frame()
        if top is not None and top[1] is not None:
            # Called by another unit's recompute (not a segment's replay, which names
            # its calls): not a call of the step's forward; it runs inside that region.
            return self.wrappers[0](*args, **kwargs)
        k = self.clock.advance(self.module_path, len(self.wrappers))
        out = self.wrappers[k](*args, **kwargs)
        if k == 0:
            self.clock.arm(out)
        return out
