"""gradckpt's plan executed *by* the compiler: one compiled graph, the plan's decisions inside it.

An execution backend of a plan, beside the eager one (:mod:`gradckpt.apply.apply`),
whose wrappers it reuses; ``gradckpt.fit(..., compile=True)`` runs its plan here.

:func:`gradckpt.compiled.around_regions.compile_model` compiles around gradckpt's
own regions (each region is a graph break, its body compiled apart). This
module instead hands the plan to the compiler: every planned unit's forward
becomes a ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
call with a selective-checkpoint policy, which Dynamo traces into the model's
graph and AOT autograd's min-cut partitioner honours:

* ``keep``: the unit runs plainly; the partitioner saves what it likes;
* ``recompute``: a checkpoint region (every op in it recomputable);
* ``selective``: a checkpoint region whose planned op outputs are tagged
  ``MUST_SAVE`` and the rest ``PREFER_RECOMPUTE``.

Selective plans name ops by position in the *eager* op sequence of the unit;
the traced graph has extra ops (clones from functionalization), so positions
are translated to "the k-th call of this op" by recording one eager forward
(:func:`_occurrences`), which is why selective plans need ``loss_fn``.

Segments (one region over several units) are honoured too: each unit of a
segment is a checkpoint call whose ops all prefer recompute, and the units
share one graph id so the partitioner does not save the tensors between them
(:mod:`gradckpt.compiled.segments`). Random ops (dropout) are
saved by the partitioner, not replayed, so recomputes do not change the masks.
Dynamo's recompiles are counted (:mod:`gradckpt.compiled.watch`).

Example:
    >>> plan = gradckpt.fit(model, loss_fn, budget=0.5, segments=False)
    >>> gradckpt.compile(model, loss_fn, backend="inductor")
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradckpt.apply.apply import applied_plan, applied_units, restamp_plan
from gradckpt.apply.guard import guard_of
from gradckpt.compiled.segments import segment_contexts, segment_of
from gradckpt.compiled.watch import watch
from gradckpt.engine.decisions import Keep, Recompute, Selective
from gradckpt.engine.modes import _UNCOUNTED  # the ops a plan's positions skip
from gradckpt.planning import Plan, UnitChoice
from gradckpt.profiling.units import module_path

__all__ = ["compile", "compiled_plan", "restamp_compiled", "uncompile"]

#: model -> (plan it was compiled with, [(module, forward it had before)]).
_COMPILED: weakref.WeakKeyDictionary[nn.Module, tuple[Plan, list[tuple[nn.Module, Any]]]] = (
    weakref.WeakKeyDictionary()
)

Occurrence = tuple[str, int]  # (op name, how many calls of that op came before it in the unit)
# The decision kinds this path translates into torch's selective-checkpoint policies.
_COMPILABLE = (Keep, Recompute, Selective)


def compile(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor] | None = None,
    **compile_kwargs: Any,
) -> nn.Module:
    """Compile ``model`` in place as one graph with its applied plan honoured by the partitioner.

    Args:
        model: a model :func:`gradckpt.apply`/``fit`` installed a plan on.
            Without a plan it is simply ``model.compile(...)``.
        loss_fn: the zero-argument loss the plan was made with; needed only
            when the plan has selective units (one eager forward is recorded
            to translate op positions).
        **compile_kwargs: passed to ``nn.Module.compile`` (``backend``,
            ``mode``, ``dynamic``, ``fullgraph``, ``options``).

    Returns:
        The model, compiled in place (call :func:`uncompile` or
        :func:`gradckpt.remove` to undo).

    Example:
        >>> gradckpt.fit(model, loss_fn, budget="300MB", segments=False)
        >>> gradckpt.compile(model, loss_fn)
        >>> loss_fn().backward()  # the compiled step, with the plan inside it
    """
    plan = applied_plan(model)
    if plan is None:
        model.compile(**compile_kwargs)
        watch(model)
        return model
    modules = dict(model.named_modules())
    foreign = sorted({u.mode for u in plan.units if not isinstance(u.decision, _COMPILABLE)})
    if foreign:
        raise ValueError(
            f"gradckpt.compile: the applied plan has {foreign} decisions, which the compiler "
            "path cannot carry out (it knows keep, recompute and selective); run the plan "
            "eagerly, or with gradckpt.compiled.around_regions.compile_model"
        )
    segments = segment_of(plan)
    units = _one_per_module(plan, segments)
    selective = [u for u in units if isinstance(u.decision, Selective) and u.path not in segments]
    if selective and loss_fn is None:
        raise ValueError(
            f"gradckpt.compile: units {[u.path for u in selective]} keep single ops; pass the "
            "plan's loss_fn (gradckpt.compile(model, loss_fn)) so their op positions can be "
            "translated to the compiled graph"
        )
    if model in _COMPILED:
        uncompile(model)
    plains = {path: spec.plain for path, spec in applied_units(model).items()}
    saves = _occurrences(model, loss_fn, selective, modules, plains) if selective else {}
    plains = {module_path(path): plain for path, plain in plains.items()}
    replaced: list[tuple[nn.Module, Any]] = []
    for unit in units:
        module = modules[unit.path]
        replaced.append((module, module.__dict__.get("forward")))
        if unit.path in segments:
            context_fn = functools.partial(segment_contexts, *segments[unit.path], unit.path)
        elif not isinstance(unit.decision, Keep):
            context_fn = functools.partial(
                _sac_contexts, frozenset(saves.get(unit.path, ())), unit.path
            )
        else:
            context_fn = None
        module.forward = _compiled_forward(plains[unit.path], context_fn)
    _COMPILED[model] = (plan, replaced)
    model.compile(**compile_kwargs)
    stats = watch(model)
    guard = guard_of(model)
    if guard is not None:  # fit(..., compile=True): shape_stats shows the recompiles too
        guard.recompiles = lambda: stats().recompiles
    return model


def _one_per_module(plan: Plan, segments: dict) -> list[UnitChoice]:
    """The plan's units by module: the compiled graph takes one decision per module.

    The calls of a module called several times per step (``path#k``) must then share
    one decision outside segments; a plan that gives them their own runs eagerly.
    """
    by_module: dict[str, list[UnitChoice]] = {}
    for unit in plan.units:
        by_module.setdefault(module_path(unit.path), []).append(unit)
    out = []
    for path, calls in by_module.items():
        if len(calls) > 1 and (
            len({c.decision for c in calls}) > 1 or any(c.path in segments for c in calls)
        ):
            raise ValueError(
                f"gradckpt.compile: the plan gives the calls of {path} (a module called "
                f"{len(calls)} times per step) decisions of their own, and the compiled graph "
                "holds one per module; run the plan eagerly, or compile around its regions "
                "(gradckpt.compiled.around_regions.compile_model)"
            )
        out.append(UnitChoice(path, calls[0].decision))
    return out


def compiled_plan(model: nn.Module) -> Plan | None:
    """The plan :func:`compile` put inside ``model``'s compiled graph, or None."""
    entry = _COMPILED.get(model)
    return entry[0] if entry is not None else None


def restamp_compiled(model: nn.Module, plan: Plan) -> None:
    """Record ``plan`` (the compiled decisions, other measured fields) as what ``model`` runs."""
    entry = _COMPILED.get(model)
    if entry is None or entry[0].items != plan.items:
        raise ValueError("restamp_compiled: the model is not compiled with this plan's decisions")
    _COMPILED[model] = (plan, entry[1])
    restamp_plan(model, plan)


def uncompile(model: nn.Module) -> nn.Module:
    """Undo :func:`compile`: gradckpt's eager wrappers back, the model's compiled call dropped.

    Example:
        >>> gradckpt.compile(model); uncompile(model)  # eager plan again
    """
    entry = _COMPILED.pop(model, None)
    if entry is not None:
        for module, previous in reversed(entry[1]):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
    model._compiled_call_impl = None
    return model


def _compiled_forward(
    plain: Callable[..., Any], context_fn: Callable[[], tuple[Any, Any]] | None
) -> Callable[..., Any]:
    """The unit's forward as the compiler should see it: a checkpoint call with ``context_fn``.

    None: the unit is kept and runs plainly (see the module docstring).
    """
    if context_fn is None:
        forward = plain
    else:
        eager_plain = torch.compiler.disable(plain)

        def body(*args: Any, **kwargs: Any) -> Any:
            # Traced into the graph when Dynamo captures the region; when it cannot
            # (a graph break inside), the region runs eagerly, and its body must too:
            # a forward run as compiled frames would save other ops than the eager
            # recompute replays.
            if torch.compiler.is_compiling():
                return plain(*args, **kwargs)
            return eager_plain(*args, **kwargs)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(
                body, *args, use_reentrant=False, context_fn=context_fn, **kwargs
            )

    @functools.wraps(plain)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    wrapper.__gradckpt_original__ = plain  # type: ignore[attr-defined]  # re-apply finds it
    return wrapper


def _sac_contexts(saves: frozenset[Occurrence], path: str) -> tuple[Any, Any]:
    """Fresh SAC contexts for one region call: MUST_SAVE at the planned occurrences."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        name = str(op)
        seen = counts[bool(ctx.is_recompute)]
        index = seen[name]
        seen[name] += 1
        if (name, index) in saves:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy.__name__ = f"gradckpt_compiled_policy({path})"
    return create_selective_checkpoint_contexts(policy)


class _OpRecorder(TorchDispatchMode):
    """Names of the ATen ops run under it, in order (what gradckpt's policies index)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in _UNCOUNTED:  # positions count what the engine's policies count
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _occurrences(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    selective: list[UnitChoice],
    modules: dict[str, nn.Module],
    plains: dict[str, Callable[..., Any]],
) -> dict[str, tuple[Occurrence, ...]]:
    """Per selective unit, its saved op positions as (op name, occurrence), from one eager forward."""
    recorded: dict[str, list[str]] = {}
    originals = {u.path: modules[u.path].__dict__.get("forward") for u in selective}

    def recording(path: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if path in recorded:  # a unit called twice: the first call defines positions
                return plains[path](*args, **kwargs)
            with _OpRecorder() as rec:
                out = plains[path](*args, **kwargs)
            recorded[path] = rec.names
            return out

        return forward

    try:
        for unit in selective:
            modules[unit.path].forward = recording(unit.path)
        with torch.random.fork_rng(devices=[]):
            loss_fn()  # with grad: the ops recorded are the training step's
    finally:
        for path, previous in originals.items():
            if previous is None:
                modules[path].__dict__.pop("forward", None)
            else:
                modules[path].forward = previous
    result: dict[str, tuple[Occurrence, ...]] = {}
    for unit in selective:
        names = recorded.get(unit.path)
        if names is None:
            raise ValueError(f"gradckpt.compile: loss_fn never called unit {unit.path!r}")
        saves = []
        for index, expected in zip(unit.save, unit.save_ops):
            if index >= len(names) or names[index] != expected:
                warnings.warn(
                    f"gradckpt.compile: op #{index} of {unit.path} is not {expected} in this run; "
                    "it is recomputed. Plan again for this model and batch.",
                    stacklevel=3,
                )
                continue
            saves.append((expected, names[:index].count(expected)))
        result[unit.path] = tuple(saves)
    return result
