"""The forward wrappers ``apply`` installs on a model's units.

Each planned unit gets an instance-level ``forward`` that decides, at call
time, how the unit runs:

* inside the forward of a region, plainly (the region recomputes it);
* as the first unit of a segment that belongs to the current level, by opening
  that segment's region (it stays open across the next units' calls, and the
  segment's last unit closes it);
* otherwise by its own decision, as its kind's handler runs it: plainly
  (``Keep``) or in its own region (``Recompute``/``Selective``).

"The current level" is what the engine is doing: nothing (top level) or
recomputing a segment. A segment's recompute calls its units' wrappers again,
so the segments and regions nested in it open during that recompute, which is
the schedule the planner's dynamic program chose.

Under ``torch.compile`` a wrapper that Dynamo traces inlines a kept unit (it
compiles with its caller) and makes every other case a graph break that runs
the logic above eagerly (:mod:`gradckpt.engine.dynamo`). A unit may carry a
compiled body (``UnitSpec.compiled``, set by ``gradckpt.compiled.around_regions``):
it then runs that body wherever it would run ``plain``, except as a selective
region, whose policy must see every op; regions whose bodies are compiled
rerun them compiled (``Frame(compiled=True)``).

Wrappers are objects, not closures (:class:`UnitForward`, :class:`RootGuard`):
a copy of the model (deepcopy, pickle, ``torch.save``) carries wrappers bound
to its own modules. Segments open only while the model's own forward runs on
the thread (a call of one block or a slice runs each unit as its own choice);
their regions and replay live in :mod:`gradckpt.apply.segment`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from gradckpt.apply import guard as shape_guard
from gradckpt.apply.guard_lean import NOT_USUAL, run_usual
from gradckpt.apply.segment import SegmentFrame, open_segment, run_segment_start
from gradckpt.apply.specs import (
    PlanPolicy,
    SegmentSpec,
    UnitSpec,
    call_in_region,
    fsdp_sharded,
    plan_policy,
    portable,
    rebound,
    segment_error,
)
from gradckpt.engine import dynamo
from gradckpt.engine.decisions import Keep
from gradckpt.engine.holders import CheckpointError, active_frame, region_stack

__all__ = [
    "PlanPolicy",
    "RootGuard",
    "SegmentSpec",
    "UnitForward",
    "UnitSpec",
    "fsdp_sharded",
    "make_opaque",
    "make_root_guard",
    "make_wrapper",
    "plan_policy",
    "segment_error",
]


class UnitForward:
    """The ``forward`` installed on a unit: decides at call time how the unit runs.

    An object, not a closure: its state (the unit's spec, holding the module and
    its plain forward) is copied with the model, so ``copy.deepcopy``, pickle
    and ``torch.save`` give a model whose wrappers run *its* modules.
    """

    # (what a wrapper pickled before these attributes existed reads)
    passthrough = False
    segmented = True

    def __init__(
        self, unit: UnitSpec, units: dict[str, UnitSpec], segmented: bool | None = None
    ) -> None:
        self.unit = unit
        self.units = units
        if segmented is None:
            segmented = any(u.segments for u in units.values())
        # A kept unit outside every segment runs plainly wherever it is called, unless a
        # segment is open around the call (then it is out of the planned order).
        self.passthrough = type(unit.decision) is Keep and not unit.segments
        self.segmented = segmented
        self.shape_checked = False
        self.root: RootGuard | None = None  # the model's guard, when the plan has segments
        self.active = True  # False once removed while another wrapper still calls this one

    @property
    def __gradckpt_original__(self) -> Callable[..., Any]:
        return self.unit.plain

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        unit = self.unit
        if not self.active:
            return unit.plain(*args, **kwargs)
        if (
            self.passthrough
            and unit.compiled is None
            and (not self.segmented or open_segment(active_frame()) is None)
        ):
            # A kept unit where no segment is open runs plainly on every path of run()
            # (in a region's forward or recompute, without grad, traced): only its shape
            # check is left, so the plan costs nothing per call beyond it.
            if unit.expected_shape is not None and not dynamo.is_compiling():
                _check_unit_shape(self, args, kwargs)
            return unit.plain(*args, **kwargs)
        if dynamo.is_compiling():
            # Traced by Dynamo: a kept unit compiles with its caller; anything
            # that opens or joins a region runs eagerly behind a graph break.
            if not torch.is_grad_enabled() or not (unit.handler.opens_region or unit.segments):
                return unit.plain(*args, **kwargs)
            return dynamo.opaque(self.run)(*args, **kwargs)
        return self.run(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        unit, units = self.unit, self.units
        if not torch.is_grad_enabled():
            return (unit.compiled or unit.plain)(*args, **kwargs)
        top = active_frame()
        if top is not None and top[1] is None:
            # Inside some region's forward: run plainly; close our segment at its end.
            segment = open_segment(top)
            if segment is not None:
                flat, tree = tree_flatten((args, kwargs))
                segment.record(unit.path, flat, tree)
            try:
                out = call_in_region(unit, args, kwargs)
            except BaseException as exc:
                if segment is not None:
                    segment.end(exc)
                raise
            if segment is not None:
                if segment.segment.paths[-1] == unit.path:
                    segment.end()  # no unit follows: nothing to hand over, nothing to note
                else:
                    segment.note_output(out)
            return out
        if unit.expected_shape is not None:
            _check_unit_shape(self, args, kwargs)
        context = getattr(top[0], "segment", None) if top is not None else None
        chain = unit.segments
        level = chain.index(context) + 1 if context in chain else 0
        if level < len(chain) and top is None and not _running(self.root):
            # Called outside the model's forward (a block alone, a slice of the
            # model): no planned segment spans this call, so the unit runs as its
            # own choice says, opening nothing that outlives the call.
            level = len(chain)
        if level < len(chain):
            spec = chain[level]
            if spec.paths[0] != unit.path:
                raise CheckpointError(
                    f"gradckpt: {unit.path} ran before the first unit of {spec.name}; the "
                    "forward does not call the units in the planned order. Plan again."
                )
            return run_segment_start(spec, unit, units, args, kwargs)
        # The unit's own decision: its kind says how it runs (gradckpt.planning.kinds).
        return unit.handler.run(unit, args, kwargs, in_recompute=top is not None)


class OpaqueUnitForward(UnitForward):
    """A :class:`UnitForward` whose call Dynamo does not trace (see ``prepare_for_compile``)."""


def make_wrapper(
    unit: UnitSpec, units: dict[str, UnitSpec], segmented: bool | None = None
) -> UnitForward:
    """The ``forward`` installed on ``unit.module`` (``segmented``: the plan has segments;
    None works it out from ``units``)."""
    return UnitForward(unit, units, segmented)


def _first_shape(args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    flat, _ = tree_flatten((args, kwargs))
    first = next((x for x in flat if isinstance(x, torch.Tensor)), None)
    return tuple(first.shape) if first is not None else None


def _check_unit_shape(wrapper: UnitForward, args: tuple, kwargs: dict) -> None:
    """Compare a unit's input shape with its plan's, where no model-level key decides.

    Inside a guarded model call whose key is being learned (a plan applied
    alone), the call's record hears of it: one warning per key, not per unit.
    Inside a guarded call whose key is known, nothing to do. Outside any
    model call (a block called alone), the unit warns once itself.
    """
    unit = wrapper.unit
    assert unit.expected_shape is not None
    entry = shape_guard.learning()
    if entry is not None:
        got = _first_shape(args, kwargs)
        if got is not None:
            entry.unit_called(unit.path, unit.expected_shape, got)
        return
    if wrapper.shape_checked or _running_roots():
        return
    wrapper.shape_checked = True
    got = _first_shape(args, kwargs)
    if got is not None and got != unit.expected_shape:
        warnings.warn(
            f"gradckpt: {unit.path} was planned for inputs of shape {unit.expected_shape} but "
            f"got {got}; the plan still runs correctly, but its predicted peak "
            "and overhead are for the planned shape. Plan again for this shape.",
            stacklevel=4,
        )


class RootGuard:
    """The model's own forward, wrapped so no segment outlives the call that opened it.

    A segment's region stays open across several unit calls; if an exception
    escapes between two of them (outside every unit wrapper), its hooks would
    stay installed. The guard closes whatever segments the call left open.
    An object holding the model's bound forward, so copies of the model call
    their own forward. Every call is first checked by the model's shape guard,
    if it has one (:mod:`gradckpt.apply.guard`).
    """

    # The shape check; OpaqueRootGuard's is Dynamo-disabled, since under a compiled
    # caller ``run`` is traced (only ``__call__``'s frame is skipped) and the
    # check, which may plan a new shape, must run eagerly.
    check = staticmethod(shape_guard.check)
    finish = staticmethod(shape_guard.finish)
    returned = staticmethod(shape_guard.returned)
    raised = staticmethod(shape_guard.raised)

    #: The plan has no segments and its units check no shapes of their own: the usual
    #: call needs only the shape guard's step (apply sets it; a copy pickled before reads False).
    lean = False

    def __init__(self, forward: Callable[..., Any], lean: bool = False) -> None:
        self.forward = forward
        self.active = True  # False once removed while another wrapper still calls this one
        self.lean = lean

    def __getstate__(self) -> dict[str, Any]:
        return {"forward": portable(self.forward), "active": self.active, "lean": self.lean}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.forward = rebound(state["forward"])
        self.active = state.get("active", True)
        self.lean = state.get("lean", False)

    @property
    def __gradckpt_original__(self) -> Callable[..., Any]:
        return self.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.lean and self.active and not dynamo.frames_watched():
            # The usual call of a plan without segments: no segment to close, no unit
            # that asks which model call runs; the guard begins the step and follows it.
            # (Not while Dynamo traces or watches: frames_watched is True then.)
            out = run_usual(self.forward, args, kwargs)
            if out is not NOT_USUAL:
                return out
        if not self.active:
            return self.forward(*args, **kwargs)
        if dynamo.is_compiling():
            # Skip only the guard's frame: the model's own forward still compiles.
            return dynamo.opaque(self.run, recursive=False)(*args, **kwargs)
        return self.run(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        # Every call is checked: the guard follows each step's calls (which one of the
        # step this is), and reads a call with the last shapes from a small cache. Where
        # Dynamo watches no frame, the plain functions (their disabled wrappers cost as
        # much as they do).
        watched = dynamo.frames_watched()
        check = self.check if watched else shape_guard.check
        verdict = check(self.forward, args, kwargs)  # [shapes #9] may switch plans
        learning = verdict if isinstance(verdict, shape_guard.Learning) else None
        if verdict is not None and learning is None and verdict is not self:
            return verdict(*args, **kwargs)  # the new plan's root runs this call
        depth = _stack_depth()
        roots = _running_roots()
        roots.append(self)
        completed = False
        try:
            out = self.forward(*args, **kwargs)
            completed = True
            # the guard follows the step's calls
            (self.returned if watched else shape_guard.returned)(self.forward, out)
            return out
        except BaseException as exc:
            _close_segments_above(depth, exc)
            (self.raised if watched else shape_guard.raised)(self.forward)
            raise
        finally:
            roots.pop()
            if learning is not None:  # the units checked this call's shapes: the guard learns
                self.finish(learning, completed)
            if len(region_stack()) > depth and _close_segments_above(depth, None):
                raise CheckpointError(
                    "gradckpt: a planned segment was still open when the forward returned; "
                    "the forward did not call the segment's units in the planned order. "
                    "Plan the model again."
                )


class OpaqueRootGuard(RootGuard):
    """A :class:`RootGuard` whose own frame Dynamo skips (see ``prepare_for_compile``)."""


def make_root_guard(forward: Callable[..., Any], lean: bool = False) -> RootGuard:
    """The guard installed as the model's ``forward`` (``lean``: see :attr:`RootGuard.lean`)."""
    return RootGuard(forward, lean)


def make_opaque(forward: UnitForward | RootGuard) -> None:
    """Let compiled callers graph-break at ``forward`` instead of tracing into it.

    The switch is of class (the classes' calls are made Dynamo-disabled once,
    here, so Dynamo is imported only by callers that compile), so the object
    stays a plain, copyable and picklable one.
    """
    for cls, base, recursive in (
        (OpaqueUnitForward, UnitForward, True),
        (OpaqueRootGuard, RootGuard, False),
    ):
        if "_gradckpt_disabled" not in cls.__dict__:
            cls.__call__ = torch.compiler.disable(base.__call__, recursive=recursive)
            if cls is OpaqueRootGuard:
                cls.check = staticmethod(torch.compiler.disable(shape_guard.check))
                cls.finish = staticmethod(torch.compiler.disable(shape_guard.finish))
                cls.returned = staticmethod(torch.compiler.disable(shape_guard.returned))
                cls.raised = staticmethod(torch.compiler.disable(shape_guard.raised))
            cls._gradckpt_disabled = True
    if type(forward) is UnitForward:
        forward.__class__ = OpaqueUnitForward
    elif type(forward) is RootGuard:
        forward.__class__ = OpaqueRootGuard


_LOCAL = threading.local()


def _running_roots() -> list[RootGuard]:
    """The model forwards (guards) running on this thread, innermost last."""
    roots = getattr(_LOCAL, "roots", None)
    if roots is None:
        roots = _LOCAL.roots = []
    return roots


def _running(root: RootGuard | None) -> bool:
    return root is not None and any(r is root for r in _running_roots())


def _stack_depth() -> int:
    return len(region_stack())


def _close_segments_above(depth: int, exc: BaseException | None) -> bool:
    closed = False
    stack = region_stack()
    while len(stack) > depth:
        frame, gid = stack[-1]
        if gid is not None or not isinstance(frame, SegmentFrame):
            break
        frame.end(exc if exc is not None else CheckpointError("segment left open"))
        closed = True
    return closed
