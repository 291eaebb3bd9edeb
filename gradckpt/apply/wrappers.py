"""The forward wrappers ``apply`` installs on a model's units.

Each planned unit gets an instance-level ``forward`` that decides, at call
time, how the unit runs:

* inside the forward of a region, plainly (the region recomputes it);
* as the first unit of a segment that belongs to the current level, by opening
  that segment's region (it stays open across the next units' calls, and the
  segment's last unit closes it);
* otherwise by its own choice: plainly (``keep``) or in its own region
  (``recompute``/``selective``).

"The current level" is what the engine is doing: nothing (top level) or
recomputing a segment. A segment's recompute calls its units' wrappers again,
so the segments and regions nested in it open during that recompute, which is
the schedule the planner's dynamic program chose.

Under ``torch.compile`` a wrapper that Dynamo traces inlines a kept unit (it
compiles with its caller) and makes every other case a graph break that runs
the logic above eagerly (:mod:`gradckpt.engine.dynamo`). A unit may carry a
compiled body (``UnitSpec.compiled``, set by ``gradckpt.integrations.compile``):
it then runs that body wherever it would run ``plain``, except as a selective
region, whose policy must see every op; regions whose bodies are compiled
rerun them compiled (``Frame(compiled=True)``).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradckpt.apply import guard as shape_guard
from gradckpt.engine import dynamo
from gradckpt.engine.checkpoint import run_checkpointed
from gradckpt.engine.decisions import RECOMPUTE, SAVE, Decision, PolicyContext
from gradckpt.engine.frame import Frame
from gradckpt.engine.holders import CheckpointError, active_frame

__all__ = [
    "SegmentSpec",
    "UnitSpec",
    "fsdp_sharded",
    "make_root_guard",
    "make_wrapper",
    "plan_policy",
]

_FSDP_CLASSES = ("FSDPModule", "FullyShardedDataParallel")


def fsdp_sharded(module: nn.Module) -> str | None:
    """The path of a submodule of ``module`` that FSDP shards (itself: ""), or None.

    Such a module's parameters are gathered only around its own forward and
    backward, so a segment (one region over several units, recomputed during
    its last unit's backward) cannot rerun it. Recognized by class name, so
    ``torch.distributed`` is never imported here.
    """
    for path, m in module.named_modules():
        for cls in type(m).__mro__:
            if cls.__name__ in _FSDP_CLASSES and cls.__module__.startswith("torch.distributed"):
                return path
    return None


def segment_error(name: str, path: str) -> str:
    return (
        f"gradckpt: {name} spans {path}, which FSDP shards. A segment recomputes all its "
        "units during its last unit's backward, when FSDP holds the others' parameters "
        "sharded. Plan with segments=False (gradckpt.plan(..., segments=False), or "
        "gradckpt.integrations.distributed.plan_for_fsdp) before fully_shard."
    )


def plan_policy(
    path: str, save: tuple[int, ...], names: tuple[str, ...]
) -> Callable[..., Decision]:
    """Keep the ops at positions ``save``; warn (and recompute) if an op there is not the planned one."""
    expected = dict(zip(save, names))
    warned: list[bool] = []

    def policy(ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        name = expected.get(ctx.index)
        if name is None:
            return RECOMPUTE
        if str(op) == name:
            return SAVE
        if not warned:
            warned.append(True)
            warnings.warn(
                f"gradckpt: op #{ctx.index} of {path} is {op}, but the plan expected {name}; "
                "it is recomputed instead of kept. Was the model or its inputs changed "
                "since planning? Plan again to get the predicted memory.",
                stacklevel=2,
            )
        return RECOMPUTE

    policy.__name__ = f"plan_policy({path})"
    return policy


@dataclass(eq=False)
class SegmentSpec:
    """A planned segment: its units in order and its enclosing segment."""

    paths: tuple[str, ...]
    parent: SegmentSpec | None = None

    @property
    def name(self) -> str:
        return f"segment[{self.paths[0]}..{self.paths[-1]}]"


@dataclass(eq=False)
class UnitSpec:
    """What a unit's wrapper needs: its choice and the segments enclosing it."""

    path: str
    module: nn.Module
    plain: Callable[..., Any]
    mode: str = "keep"
    policy: Callable[..., Any] | None = None
    segments: list[SegmentSpec] = field(default_factory=list)  # outermost first
    expected_shape: tuple[int, ...] | None = None
    compiled: Callable[..., Any] | None = None  # a torch.compile'd ``plain``, if any

    @property
    def body(self) -> Callable[..., Any] | None:
        """The compiled body this unit runs in regions, or None (runs ``plain`` eagerly)."""
        return self.compiled if self.mode != "selective" else None

    def buffers(self) -> list[torch.Tensor]:
        return list(self.module.buffers())


def _call_in_region(unit: UnitSpec, args: tuple, kwargs: dict) -> Any:
    """Run the unit inside a region (forward or recompute): the same way both times."""
    if unit.body is not None:
        return unit.body(*args, **kwargs)
    with dynamo.eager():
        return unit.plain(*args, **kwargs)


class _SegmentFrame(Frame):
    """A segment's region: records each unit call so its recompute can replay them."""

    def __init__(self, spec: SegmentSpec, units: dict[str, UnitSpec]) -> None:
        members = [units[p] for p in spec.paths]
        for unit in members:
            sharded = fsdp_sharded(unit.module)
            if sharded is not None:
                raise CheckpointError(
                    segment_error(spec.name, ".".join(x for x in (unit.path, sharded) if x))
                )
        super().__init__(
            None,
            name=spec.name,
            compiled=any(u.body is not None for u in members),
            state=lambda: [b for u in members for b in u.buffers()],
        )
        self.segment = spec
        self.units = units
        self.calls: list[tuple[list[Any], Any, int]] = []  # flat args, spec, chain position
        self._last_output: weakref.ref | None = None

    def record(self, spec_path: str, flat: list[Any], tree: Any) -> None:
        expected = (
            self.segment.paths[len(self.calls)]
            if len(self.calls) < len(self.segment.paths)
            else None
        )
        if spec_path != expected:
            raise CheckpointError(
                f"gradckpt: {spec_path} ran inside {self.segment.name}, where {expected} was "
                "planned next; the forward does not call the units in the planned order. "
                "Plan the model again."
            )
        # Keep what the replay needs but no activation made inside the segment:
        # the first call's tensors are the frame's saved inputs, and each later
        # call's chain input is the previous unit's replayed output.
        if not self.calls:
            self.calls.append(([None] * len(flat), tree, -1))
            return
        last = self._last_output() if self._last_output is not None else None
        for i, x in enumerate(flat):
            if last is not None and x is last:
                kept = list(flat)
                kept[i] = None
                self.calls.append((kept, tree, i))
                return
        raise CheckpointError(
            f"gradckpt: {spec_path} did not receive the output of the unit before it, so "
            f"{self.segment.name} cannot be recomputed as one region. The plan was made for "
            "a forward that chains these units; plan the model again."
        )

    def note_output(self, out: Any) -> None:
        flat, _ = tree_flatten(out)
        first = next((x for x in flat if isinstance(x, torch.Tensor)), None)
        self._last_output = weakref.ref(first) if first is not None else None

    def run_body(self, inputs: list[Any]) -> None:
        previous = None
        for path, (flat, tree, chain_at) in zip(self.segment.paths, self.calls):
            args = list(inputs) if chain_at < 0 else list(flat)
            if chain_at >= 0:
                args[chain_at] = previous
            call_args, call_kwargs = tree_unflatten(args, tree)
            out = self.units[path].module.forward(*call_args, **call_kwargs)
            flat_out, _ = tree_flatten(out)
            previous = next((x for x in flat_out if isinstance(x, torch.Tensor)), None)


def _open_segment(top: tuple[Frame, int | None] | None) -> _SegmentFrame | None:
    if top is not None and top[1] is None and isinstance(top[0], _SegmentFrame):
        return top[0]
    return None


def make_wrapper(unit: UnitSpec, units: dict[str, UnitSpec]) -> Callable[..., Any]:
    """The ``forward`` installed on ``unit.module``."""
    shape_checked: list[bool] = []

    def forward(*args: Any, **kwargs: Any) -> Any:
        if dynamo.is_compiling():
            # Traced by Dynamo: a kept unit compiles with its caller; anything
            # that opens or joins a region runs eagerly behind a graph break.
            if not torch.is_grad_enabled() or (unit.mode == "keep" and not unit.segments):
                return unit.plain(*args, **kwargs)
            return dynamo.opaque(run)(*args, **kwargs)
        return run(*args, **kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return (unit.compiled or unit.plain)(*args, **kwargs)
        top = active_frame()
        if top is not None and top[1] is None:
            # Inside some region's forward: run plainly; close our segment at its end.
            segment = _open_segment(top)
            if segment is not None:
                flat, tree = tree_flatten((args, kwargs))
                segment.record(unit.path, flat, tree)
            try:
                out = _call_in_region(unit, args, kwargs)
            except BaseException as exc:
                if segment is not None:
                    segment.end(exc)
                raise
            if segment is not None:
                segment.note_output(out)
                if segment.segment.paths[-1] == unit.path:
                    segment.end()
            return out
        if not shape_checked:
            shape_checked.append(True)
            _check_shape(unit, args, kwargs)
        context = getattr(top[0], "segment", None) if top is not None else None
        chain = unit.segments
        level = chain.index(context) + 1 if context in chain else 0
        if level < len(chain):
            spec = chain[level]
            if spec.paths[0] != unit.path:
                raise CheckpointError(
                    f"gradckpt: {unit.path} ran before the first unit of {spec.name}; the "
                    "forward does not call the units in the planned order. Plan again."
                )
            return _run_segment_start(spec, unit, units, args, kwargs)
        if unit.mode == "keep":
            if top is not None:
                # A segment's recompute: run as its forward ran this unit.
                return _call_in_region(unit, args, kwargs)
            return (unit.body or unit.plain)(*args, **kwargs)
        if unit.body is not None:
            return run_checkpointed(
                unit.body, args, kwargs, name=unit.path, compiled=True, state=unit.buffers
            )
        return run_checkpointed(unit.plain, args, kwargs, policy=unit.policy, name=unit.path)

    forward.__gradckpt_original__ = unit.plain  # type: ignore[attr-defined]
    return forward


def _run_segment_start(
    spec: SegmentSpec, unit: UnitSpec, units: dict[str, UnitSpec], args: tuple, kwargs: dict
) -> Any:
    frame = _SegmentFrame(spec, units)
    flat, tree = tree_flatten((args, kwargs))
    frame.save_inputs(flat)
    frame.begin()
    frame.record(unit.path, flat, tree)
    try:
        out = _call_in_region(unit, args, kwargs)
    except BaseException as exc:
        frame.end(exc)
        raise
    frame.note_output(out)
    return out


def _check_shape(unit: UnitSpec, args: tuple, kwargs: dict) -> None:
    if unit.expected_shape is None:
        return
    flat, _ = tree_flatten((args, kwargs))
    first = next((x for x in flat if isinstance(x, torch.Tensor)), None)
    if first is not None and tuple(first.shape) != unit.expected_shape:
        warnings.warn(
            f"gradckpt: {unit.path} was planned for inputs of shape {unit.expected_shape} but "
            f"got {tuple(first.shape)}; the plan still runs correctly, but its predicted peak "
            "and overhead are for the planned shape. Plan again for this shape.",
            stacklevel=3,
        )


def make_root_guard(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the model's own forward so no segment outlives the call that opened it.

    A segment's region stays open across several unit calls; if an exception
    escapes between two of them (outside every unit wrapper), its hooks would
    stay installed. The guard closes whatever segments the call left open.
    Every call is first checked by the model's shape guard, if it has one.
    """

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if dynamo.is_compiling():
            # Skip only the guard's frame: the model's own forward still compiles.
            return dynamo.opaque(run, recursive=False)(*args, **kwargs)
        return run(*args, **kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        shape_guard.check(forward, args, kwargs)  # [shapes #9] may switch or re-plan first
        depth = _stack_depth()
        try:
            return forward(*args, **kwargs)
        except BaseException as exc:
            _close_segments_above(depth, exc)
            raise
        finally:
            if _close_segments_above(depth, None):
                raise CheckpointError(
                    "gradckpt: a planned segment was still open when the forward returned; "
                    "the forward did not call the segment's units in the planned order. "
                    "Plan the model again."
                )

    guarded.__gradckpt_original__ = forward  # type: ignore[attr-defined]
    guarded.__gradckpt_guard__ = run  # type: ignore[attr-defined]
    return guarded


def _stack_depth() -> int:
    from gradckpt.engine.holders import region_stack as _stack

    return len(_stack())


def _close_segments_above(depth: int, exc: BaseException | None) -> bool:
    from gradckpt.engine.holders import region_stack as _stack

    closed = False
    stack = _stack()
    while len(stack) > depth:
        frame, gid = stack[-1]
        if gid is not None or not isinstance(frame, _SegmentFrame):
            break
        frame.end(exc if exc is not None else CheckpointError("segment left open"))
        closed = True
    return closed
