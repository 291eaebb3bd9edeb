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

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradckpt.engine import dynamo
from gradckpt.engine.checkpoint import run_checkpointed
from gradckpt.engine.decisions import RECOMPUTE, SAVE, Decision, PolicyContext
from gradckpt.engine.frame import Frame
from gradckpt.engine.holders import CheckpointError, active_frame

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


class PlanPolicy:
    """Keep the ops at positions ``save``; warn (and recompute) if an op there is not the planned one.

    An object rather than a closure so an applied model can be pickled.
    """

    def __init__(self, path: str, save: tuple[int, ...], names: tuple[str, ...]) -> None:
        self.path = path
        self.expected = dict(zip(save, names))
        self.warned = False
        self.__name__ = f"plan_policy({path})"

    def __call__(self, ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        name = self.expected.get(ctx.index)
        if name is None:
            return RECOMPUTE
        if str(op) == name:
            return SAVE
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"gradckpt: op #{ctx.index} of {self.path} is {op}, but the plan expected "
                f"{name}; it is recomputed instead of kept. Was the model or its inputs "
                "changed since planning? Plan again to get the predicted memory.",
                stacklevel=2,
            )
        return RECOMPUTE


def plan_policy(path: str, save: tuple[int, ...], names: tuple[str, ...]) -> PlanPolicy:
    """The per-op policy of a selective unit (see :class:`PlanPolicy`)."""
    return PlanPolicy(path, save, names)


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

    def __getstate__(self) -> dict[str, Any]:
        # A compiled body closes over the original module: a copy (deepcopy,
        # pickle) runs its own module eagerly until it is compiled again.
        return {**self.__dict__, "plain": _portable(self.plain), "compiled": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, plain=_rebound(state["plain"]))


class _ClassMethodOf:
    """Stands for ``type(owner).<name>`` bound to ``owner`` while a model is copied."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner = owner
        self.name = name


def _portable(fn: Callable[..., Any]) -> Any:
    """``fn`` in a form that copies and pickles to the copy's own method.

    Pickle stores a bound method as ``getattr(owner, name)``, which on loading
    finds the *instance* attribute ``forward``, i.e. the wrapper itself, so the
    class's method is named explicitly instead.
    """
    owner, func = getattr(fn, "__self__", None), getattr(fn, "__func__", None)
    name = getattr(func, "__name__", None)
    if owner is not None and name is not None and getattr(type(owner), name, None) is func:
        return _ClassMethodOf(owner, name)
    return fn


def _rebound(fn: Any) -> Callable[..., Any]:
    if isinstance(fn, _ClassMethodOf):
        return getattr(type(fn.owner), fn.name).__get__(fn.owner)
    return fn


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
        self._last_version = 0
        # A forward hook may replace a unit's output: the next unit's chain input is
        # what the hooks returned, so note it after them (the last unit's hooks run
        # after the segment closed).
        self._output_hooks = [
            u.module.register_forward_hook(self._note_hooked_output)
            for u in members[:-1]
            if u.module._forward_hooks or nn.modules.module._global_forward_hooks
        ]
        # Likewise a pre-hook may replace a unit's inputs: record them before the
        # pre-hooks run, and the replay (which calls the module) runs them again.
        self._raw_inputs: dict[int, tuple[list[Any], Any, list[int]]] = {}
        self._output_hooks += [
            u.module.register_forward_pre_hook(
                self._note_raw_inputs, prepend=True, with_kwargs=True
            )
            for u in members[1:]
            if u.module._forward_pre_hooks or nn.modules.module._global_forward_pre_hooks
        ]

    def _note_raw_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._exit is not None:
            flat, tree = tree_flatten((args, kwargs))
            versions = [x._version if isinstance(x, torch.Tensor) else 0 for x in flat]
            self._raw_inputs[id(module)] = (flat, tree, versions)

    def _note_hooked_output(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._exit is not None:  # still the segment's forward
            self.note_output(out)

    def end(self, exc: BaseException | None = None) -> None:
        for handle in self._output_hooks:
            handle.remove()
        self._output_hooks = []
        super().end(exc)

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
        versions = [x._version if isinstance(x, torch.Tensor) else 0 for x in flat]
        raw = self._raw_inputs.pop(id(self.units[spec_path].module), None)
        if raw is not None:  # the inputs as they were before the unit's pre-hooks
            flat, tree, versions = raw
        last = self._last_output() if self._last_output is not None else None
        for i, x in enumerate(flat):
            if last is not None and x is last:
                if versions[i] != self._last_version:
                    # The replay hands the output straight to the next unit: code
                    # between them (an in-place edit) would not run again.
                    raise CheckpointError(
                        f"gradckpt: the forward changed the output of the unit before "
                        f"{spec_path} in place between the two units, inside "
                        f"{self.segment.name}; its recompute would not repeat that edit. "
                        "The plan was made for a forward without it: plan the model again "
                        "(no segment will span the edit)."
                    )
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
        self._last_version = first._version if first is not None else 0

    def run_body(self, inputs: list[Any]) -> None:
        # Each unit is called as a module, so its hooks run as in the forward
        # (also hooks registered after apply), except those that ran outside the
        # region: the first unit's pre-hooks (the saved inputs already passed
        # them) and the last unit's forward hooks (they ran after it closed).
        previous = None
        last = len(self.calls) - 1
        for i, (path, (flat, tree, chain_at)) in enumerate(zip(self.segment.paths, self.calls)):
            args = list(inputs) if chain_at < 0 else list(flat)
            if chain_at >= 0:
                args[chain_at] = previous
            call_args, call_kwargs = tree_unflatten(args, tree)
            module = self.units[path].module
            with _hooks_skipped(module, pre=i == 0, post=i == last):
                out = module(*call_args, **call_kwargs)
            flat_out, _ = tree_flatten(out)
            previous = next((x for x in flat_out if isinstance(x, torch.Tensor)), None)


@contextlib.contextmanager
def _hooks_skipped(module: nn.Module, *, pre: bool, post: bool) -> Iterator[None]:
    """Call ``module`` without its own forward pre-hooks (``pre``) or forward hooks (``post``)."""
    saved = {}
    for name, skip in (("_forward_pre_hooks", pre), ("_forward_hooks", post)):
        if skip and getattr(module, name):
            saved[name] = module.__dict__[name]
            module.__dict__[name] = type(saved[name])()
    try:
        yield
    finally:
        module.__dict__.update(saved)


def _open_segment(top: tuple[Frame, int | None] | None) -> _SegmentFrame | None:
    if top is not None and top[1] is None and isinstance(top[0], _SegmentFrame):
        return top[0]
    return None


class UnitForward:
    """The ``forward`` installed on a unit: decides at call time how the unit runs.

    An object, not a closure: its state (the unit's spec, holding the module and
    its plain forward) is copied with the model, so ``copy.deepcopy``, pickle
    and ``torch.save`` give a model whose wrappers run *its* modules.
    """

    def __init__(self, unit: UnitSpec, units: dict[str, UnitSpec]) -> None:
        self.unit = unit
        self.units = units
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
        if dynamo.is_compiling():
            # Traced by Dynamo: a kept unit compiles with its caller; anything
            # that opens or joins a region runs eagerly behind a graph break.
            if not torch.is_grad_enabled() or (unit.mode == "keep" and not unit.segments):
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
        if not self.shape_checked:
            self.shape_checked = True
            _check_shape(unit, args, kwargs)
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


class OpaqueUnitForward(UnitForward):
    """A :class:`UnitForward` whose call Dynamo does not trace (see ``prepare_for_compile``)."""


def make_wrapper(unit: UnitSpec, units: dict[str, UnitSpec]) -> UnitForward:
    """The ``forward`` installed on ``unit.module``."""
    return UnitForward(unit, units)


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


class RootGuard:
    """The model's own forward, wrapped so no segment outlives the call that opened it.

    A segment's region stays open across several unit calls; if an exception
    escapes between two of them (outside every unit wrapper), its hooks would
    stay installed. The guard closes whatever segments the call left open.
    An object holding the model's bound forward, so copies of the model call
    their own forward.
    """

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward
        self.active = True  # False once removed while another wrapper still calls this one

    def __getstate__(self) -> dict[str, Any]:
        return {"forward": _portable(self.forward), "active": self.active}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.forward = _rebound(state["forward"])
        self.active = state.get("active", True)

    @property
    def __gradckpt_original__(self) -> Callable[..., Any]:
        return self.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.forward(*args, **kwargs)
        if dynamo.is_compiling():
            # Skip only the guard's frame: the model's own forward still compiles.
            return dynamo.opaque(self.run, recursive=False)(*args, **kwargs)
        return self.run(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        depth = _stack_depth()
        roots = _running_roots()
        roots.append(self)
        try:
            return self.forward(*args, **kwargs)
        except BaseException as exc:
            _close_segments_above(depth, exc)
            raise
        finally:
            roots.pop()
            if _close_segments_above(depth, None):
                raise CheckpointError(
                    "gradckpt: a planned segment was still open when the forward returned; "
                    "the forward did not call the segment's units in the planned order. "
                    "Plan the model again."
                )


class OpaqueRootGuard(RootGuard):
    """A :class:`RootGuard` whose own frame Dynamo skips (see ``prepare_for_compile``)."""


def make_root_guard(forward: Callable[..., Any]) -> RootGuard:
    """The guard installed as the model's ``forward`` when the plan has segments."""
    return RootGuard(forward)


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
