"""``apply(model, plan)`` installs a plan in place; ``remove(model)`` undoes it."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from gradckpt.apply import guard as shape_guard
from gradckpt.apply.calls import CallClock, CallsForward
from gradckpt.apply.for_compile import prepare_for_compile, wrap_unit
from gradckpt.apply.installed import (
    _STATE,
    _Installed,
    applied_plan,
    applied_units,
    installed_on,
    on_remove,
    restamp_plan,
)
from gradckpt.apply.token_chunks import token_chunked_forwards
from gradckpt.apply.wrappers import (
    SegmentSpec,
    UnitForward,
    UnitSpec,
    fsdp_sharded,
    make_root_guard,
    make_wrapper,
    segment_error,
)
from gradckpt.engine import dynamo
from gradckpt.engine.decisions import Keep
from gradckpt.planning.handlers.registry import handler_for
from gradckpt.planning.plans.plan import Plan, Segment, UnitChoice
from gradckpt.planning.plans.planset import PlanSet
from gradckpt.profiling.fingerprint import model_fingerprint
from gradckpt.profiling.units import call_path, module_path

__all__ = [
    "PlanMismatchError",
    "applied_plan",
    "applied_units",
    "apply",
    "install_guarded",
    "install_plan",
    "on_remove",
    "prepare_for_compile",
    "remove",
    "restamp_plan",
    "wrap_unit",
]


class PlanMismatchError(ValueError):
    """The plan was made for another model."""


def _specs(model: nn.Module, plan: Plan) -> dict[str, UnitSpec]:
    modules = dict(model.named_modules())
    # [shapes #9] A shape guard that knows its plan's call shape checks every call; the
    # units' check would only repeat it (and misfire on a shape run under a larger
    # shape's plan). One that does not (a plan applied alone) learns it from the units.
    guard = shape_guard.guard_of(model)
    shapes = dict(plan.input_shapes) if guard is None or guard.active is None else {}
    specs: dict[str, UnitSpec] = {}
    runtimes: dict[type, object] = {}  # per decision kind: its install(plan), made once

    def visit(items: tuple, enclosing: list[SegmentSpec]) -> None:
        for item in items:
            if isinstance(item, Segment):
                spec = SegmentSpec(item.paths, enclosing[-1] if enclosing else None)
                visit(item.items, [*enclosing, spec])
                continue
            assert isinstance(item, UnitChoice)
            module = modules.get(module_path(item.path))
            if module is None:
                raise PlanMismatchError(
                    f"the plan names {item.path!r}, which this model does not have"
                )
            if item.path in specs:
                raise ValueError(f"the plan lists {item.path!r} twice")
            plain = getattr(module.forward, "__gradckpt_original__", module.forward)
            kind = handler_for(item.decision)
            group = kind.runtime_group or type(item.decision)  # kinds may share one
            if group not in runtimes:
                runtimes[group] = kind.install(plan)
            specs[item.path] = UnitSpec(
                item.path, module, plain, item.decision, kind.policy(item.path, item.decision),
                list(enclosing), shapes.get(item.path), runtime=runtimes[group],
            )  # fmt: skip

    visit(plan.items, [])
    _check_calls(specs)
    return specs


def _check_calls(specs: dict[str, UnitSpec]) -> None:
    """A shared module's units must be its calls 0..n-1 (``path#k``), each once."""
    calls: dict[str, list[str]] = {}
    for path in specs:
        calls.setdefault(module_path(path), []).append(path)
    for module, paths in calls.items():
        if paths == [module]:
            continue
        expected = [call_path(module, k, len(paths)) for k in range(len(paths))]
        if len(paths) < 2 or sorted(paths) != sorted(expected):
            raise PlanMismatchError(
                f"the plan names {module!r} by the calls {sorted(paths)}; a module called "
                f"several times per step needs one unit for every call ({module}#0, "
                f"{module}#1, ...). Plan the model again."
            )


def _forwards(specs: dict[str, UnitSpec]) -> list[tuple[nn.Module, UnitForward | CallsForward]]:
    """The forward to install on each planned module: a unit's, or its calls' (shared)."""
    by_module: dict[str, list[UnitSpec]] = {}
    for spec in specs.values():
        by_module.setdefault(module_path(spec.path), []).append(spec)
    clock = CallClock()  # shared by the model's shared modules: one step's calls
    segmented = any(spec.segments for spec in specs.values())
    out: list[tuple[nn.Module, UnitForward | CallsForward]] = []
    for path, group in by_module.items():
        if len(group) == 1 and group[0].path == path:
            if not segmented and _runs_plainly(group[0]):
                continue  # its wrapper would only call the plain forward (#42)
            out.append((group[0].module, make_wrapper(group[0], specs, segmented)))
            continue
        ordered = [specs[call_path(path, k, len(group))] for k in range(len(group))]
        wrappers = [make_wrapper(spec, specs, segmented) for spec in ordered]
        out.append((group[0].module, CallsForward(path, wrappers, clock)))
    return out


def apply(model: nn.Module, plan: Plan | PlanSet, *, on_new_shape: str = "error") -> nn.Module:
    """Install ``plan`` on ``model`` in place and return the model.

    Idempotent: applying the same plan twice changes nothing; applying another
    plan replaces the first. Refuses a plan made for a different model
    (structure fingerprint), or with a segment over FSDP-sharded units, before
    touching anything. Apply before ``torch.compile`` and ``fully_shard``/DDP.

    A :class:`~gradckpt.PlanSet` (plans per input shape) installs a shape guard:
    every call switches to the plan of its shape; a shape the set lacks raises
    (``on_new_shape="error"``) or runs the current plan with one warning
    (``"warn"``). A single plan is guarded too, as ``"warn"``: one warning per
    new input shape (the plan's shape is learned from the first call whose
    units get the inputs they were planned for). Applying again a plan that the
    model's guard holds (``fit``'s) keeps that guard. To plan new shapes as they
    come, use ``gradckpt.fit``.

    Example:
        >>> plan = gradckpt.Plan.load("plan.json")
        >>> gradckpt.apply(model, plan)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply needs a torch.nn.Module to apply to, got {type(model).__name__}")
    if isinstance(plan, PlanSet):
        return _apply_set(model, plan, on_new_shape)
    if not isinstance(plan, Plan):
        raise TypeError(
            f"apply needs a gradckpt.Plan, got {type(plan).__name__} (read a saved plan with "
            "gradckpt.Plan.load(path))"
        )
    _check_plan(model, plan)
    held = shape_guard.guard_of(model)
    if held is not None:
        key = next((k for k, p in held.plans.items() if p == plan), _NOT_HELD)
        if key is not _NOT_HELD:  # fit's plan applied again: its guard (and re-planning) stays
            install_plan(model, plan)
            held.active = key
            return model
    # [shapes #9] any other plan applied by hand ends the guard it replaces, and gets
    # one that warns at new shapes (with the old one's predictions when it had any).
    guard = shape_guard.ShapeGuard(
        "warn", {None: plan}, None, None, predictor=held.predictor if held is not None else None
    )
    return install_guarded(model, plan, guard)


_NOT_HELD = object()


def _apply_set(model: nn.Module, plans: PlanSet, on_new_shape: str) -> nn.Module:
    if on_new_shape == "replan":
        raise ValueError(
            'apply cannot plan new shapes (it has no loss function); use on_new_shape="warn" '
            'or "error", or gradckpt.fit(model, loss_fn, budget, shapes=[...]) to re-plan'
        )
    for _, each in plans:
        _check_plan(model, each)
    first_key, first = plans.entries[0]
    # A single-plan file loads with key None: the guard learns its key from the units.
    guard = shape_guard.ShapeGuard(on_new_shape, plans.plans, first_key, None)
    return install_guarded(model, first, guard)


def _runs_plainly(spec: UnitSpec) -> bool:
    """A unit that runs its plain forward on every path: a kept one, outside every
    segment, whose shape the model's guard checks (a fresh spec has no compiled body).

    Its wrapper would cost a call per unit call and decide nothing; on short ops
    (a GPU's regime) that shows in the step, so it gets none. The root module
    keeps its wrapper (the shape guard wraps that forward), and so does a module
    whose forward someone else replaced (``gradckpt.compile``'s in-graph forwards
    stay after a re-plan: the wrapper runs the plain forward instead).
    """
    return (
        type(spec.decision) is Keep
        and "forward" not in spec.module.__dict__
        and not spec.segments
        and spec.expected_shape is None
        and spec.path != ""
    )


def install_guarded(model: nn.Module, plan: Plan, guard: shape_guard.ShapeGuard) -> nn.Module:
    """Install ``plan`` with ``guard`` checking every call (``fit``, plan sets)."""
    _check_plan(model, plan)
    shape_guard.install(model, guard)
    try:
        # Rebuilt even if the plan is installed: the root wrapper and the units' shape
        # checks are made for the guard in place. Settings made for the plan stay.
        return install_plan(model, plan, rebuild=True)
    except BaseException:
        shape_guard.forget(model)
        raise


def _check_plan(model: nn.Module, plan: Plan) -> None:
    _refuse_segments_under_fsdp(model, plan)
    fingerprint = model_fingerprint(model)
    if fingerprint != plan.fingerprint:
        raise PlanMismatchError(
            f"this plan was made for another model (fingerprint {plan.fingerprint}, this model "
            f"has {fingerprint}: different modules, parameter shapes or dtypes). Plan this "
            "model with gradckpt.plan(model, loss_fn, budget)."
        )


def install_plan(model: nn.Module, plan: Plan, rebuild: bool = False) -> nn.Module:
    """``apply`` without touching the shape guard: how the guard switches plans.

    ``rebuild``: install the wrappers again even if ``plan`` is installed already.
    """
    _check_plan(model, plan)
    current = installed_on(model)
    undo: list[Callable[[], None]] = []
    if current is not None:
        if current.plan == plan and not rebuild:
            return model
        undo = current.undo  # settings made for the plan (use_cache) stay for the next one
        current.undo = []
        _uninstall(model)
    specs = _specs(model, plan)  # validates everything before the model is touched
    names = dict(model.named_modules())
    missing = [p for p, _ in plan.token_chunks if p not in names]
    if missing:
        raise PlanMismatchError(f"the plan chunks {missing[0]!r}, which this model does not have")
    chunked = token_chunked_forwards(model, plan)  # MLPs in slices of tokens
    installed = _Installed(plan, [], specs, undo=undo)
    try:
        for module, forward in _forwards(specs):
            had_own = "forward" in module.__dict__
            installed.modules.append((module, had_own, module.__dict__.get("forward")))
            installed.installed.append(forward)
            module.forward = forward
        for module, sliced in chunked:
            had_own = "forward" in module.__dict__
            installed.modules.append((module, had_own, module.__dict__.get("forward")))
            installed.installed.append(sliced)
            module.forward = sliced
        # [shapes #9] a shape guard checks calls in the root wrapper: install it then too
        if shape_guard.guards(model) or any(isinstance(item, Segment) for item in plan.items):
            had_own = "forward" in model.__dict__
            installed.modules.append((model, had_own, model.__dict__.get("forward")))
            lean = not any(spec.segments or spec.expected_shape for spec in specs.values())
            guard = make_root_guard(model.forward, lean)
            for wrapper in installed.installed:
                wrapper.root = guard  # segments open only inside the model's forward
            installed.installed.append(guard)
            model.forward = guard
    except BaseException:
        _restore(installed)
        raise
    model.__dict__[_STATE] = installed
    if dynamo.loaded():
        prepare_for_compile(model)
    return model


shape_guard.register_installer(install_plan)  # a guard switches plans through it


def _refuse_segments_under_fsdp(model: nn.Module, plan: Plan) -> None:
    modules = dict(model.named_modules())

    def visit(items: tuple) -> None:
        for item in items:
            if isinstance(item, Segment):
                for path in item.paths:
                    module = modules.get(module_path(path))
                    sharded = fsdp_sharded(module) if module is not None else None
                    if sharded is not None:
                        name = f"segment[{item.paths[0]}..{item.paths[-1]}]"
                        raise ValueError(
                            segment_error(name, ".".join(x for x in (path, sharded) if x))
                        )
                visit(item.items)

    visit(plan.items)


def _restore(installed: _Installed) -> None:
    for i, (module, had_own, previous) in reversed(list(enumerate(installed.modules))):
        ours = installed.installed[i] if i < len(installed.installed) else None
        current = module.__dict__.get("forward")
        if ours is not None and current is not ours:
            # Another library wrapped our forward after apply (it calls ours):
            # keep its wrapper and make ours pass straight through.
            ours.active = False
            continue
        if had_own:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: the model runs exactly as before it was applied.

    Example:
        >>> gradckpt.remove(model)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"remove needs the torch.nn.Module a plan was applied to, got "
                        f"{type(model).__name__}")  # fmt: skip
    shape_guard.forget(model)
    return _uninstall(model)


def _uninstall(model: nn.Module) -> nn.Module:
    """``remove`` without ending a shape guard."""
    installed = installed_on(model)
    if installed is not None:
        del model.__dict__[_STATE]
        _restore(installed)
        for undo in reversed(installed.undo):
            undo()
    return model
