"""``apply(model, plan)`` installs a plan in place; ``remove(model)`` undoes it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import nn

from gradckpt.apply import guard as shape_guard
from gradckpt.apply.wrappers import (
    SegmentSpec,
    UnitSpec,
    fsdp_sharded,
    make_root_guard,
    make_wrapper,
    plan_policy,
    segment_error,
)
from gradckpt.engine import dynamo
from gradckpt.plan.plan import Plan, Segment, UnitChoice
from gradckpt.plan.planset import PlanSet
from gradckpt.profile.fingerprint import model_fingerprint

__all__ = [
    "PlanMismatchError",
    "applied_plan",
    "applied_units",
    "apply",
    "prepare_for_compile",
    "remove",
]


class PlanMismatchError(ValueError):
    """The plan was made for another model."""


@dataclass
class _Installed:
    plan: Plan
    modules: list[tuple[nn.Module, bool, object]]  # module, had own forward, previous forward
    units: dict[str, UnitSpec]


_INSTALLED: weakref.WeakKeyDictionary[nn.Module, _Installed] = weakref.WeakKeyDictionary()


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan installed on ``model`` by :func:`apply`, or None."""
    installed = _INSTALLED.get(model)
    return installed.plan if installed is not None else None


def applied_units(model: nn.Module) -> dict[str, UnitSpec]:
    """The installed units of ``model`` by path (empty if no plan is applied).

    Integrations adjust them in place (``gradckpt.integrations.compile`` sets
    their compiled bodies); they live until the plan is removed or replaced.
    """
    installed = _INSTALLED.get(model)
    return installed.units if installed is not None else {}


def _specs(model: nn.Module, plan: Plan) -> dict[str, UnitSpec]:
    modules = dict(model.named_modules())
    # [shapes #9] A shape guard checks every call; the units' first-call check would
    # only repeat it (and misfire on a shape run under a larger shape's plan).
    shapes = dict(plan.input_shapes) if shape_guard.guard_of(model) is None else {}
    specs: dict[str, UnitSpec] = {}

    def visit(items: tuple, enclosing: list[SegmentSpec]) -> None:
        for item in items:
            if isinstance(item, Segment):
                spec = SegmentSpec(item.paths, enclosing[-1] if enclosing else None)
                visit(item.items, [*enclosing, spec])
                continue
            assert isinstance(item, UnitChoice)
            module = modules.get(item.path)
            if module is None:
                raise PlanMismatchError(
                    f"the plan names {item.path!r}, which this model does not have"
                )
            if item.path in specs:
                raise ValueError(f"the plan lists {item.path!r} twice")
            plain = getattr(module.forward, "__gradckpt_original__", module.forward)
            policy = (
                plan_policy(item.path, item.save, item.save_ops)
                if item.mode == "selective"
                else None
            )
            specs[item.path] = UnitSpec(
                item.path, module, plain, item.mode, policy, list(enclosing),
                shapes.get(item.path),
            )  # fmt: skip

    visit(plan.items, [])
    return specs


def apply(model: nn.Module, plan: Plan | PlanSet, *, on_new_shape: str = "error") -> nn.Module:
    """Install ``plan`` on ``model`` in place and return the model.

    Idempotent: applying the same plan twice changes nothing; applying another
    plan replaces the first. Refuses a plan made for a different model
    (structure fingerprint), or with a segment over FSDP-sharded units, before
    touching anything. Apply before ``torch.compile`` and ``fully_shard``/DDP.

    A :class:`~gradckpt.PlanSet` (plans per input shape) installs a shape guard:
    every call switches to the plan of its shape; a shape the set lacks raises
    (``on_new_shape="error"``) or runs the current plan with one warning
    (``"warn"``). To plan new shapes as they come, use ``gradckpt.fit``.

    Example:
        >>> plan = gradckpt.Plan.load("plan.json")
        >>> gradckpt.apply(model, plan)
    """
    if isinstance(plan, PlanSet):
        return _apply_set(model, plan, on_new_shape)
    if not isinstance(plan, Plan):
        raise TypeError(f"apply needs a gradckpt.Plan, got {type(plan).__name__}")
    shape_guard.forget(model)  # [shapes #9] a plan applied by hand ends any shape guard
    return install_plan(model, plan)


def _apply_set(model: nn.Module, plans: PlanSet, on_new_shape: str) -> nn.Module:
    if on_new_shape == "replan":
        raise ValueError(
            'apply cannot plan new shapes (it has no loss function); use on_new_shape="warn" '
            'or "error", or gradckpt.fit(model, loss_fn, budget, shapes=[...]) to re-plan'
        )
    for _, each in plans:
        _check_plan(model, each)
    first_key, first = plans.entries[0]
    guard = shape_guard.ShapeGuard(
        on_new_shape, plans.plans, first_key, lambda p: install_plan(model, p)
    )
    return install_guarded(model, first, guard)


def install_guarded(model: nn.Module, plan: Plan, guard: shape_guard.ShapeGuard) -> nn.Module:
    """Install ``plan`` with ``guard`` checking every call (``fit``, plan sets)."""
    _check_plan(model, plan)
    remove(model)
    shape_guard.install(model, guard)
    try:
        return install_plan(model, plan)
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


def install_plan(model: nn.Module, plan: Plan) -> nn.Module:
    """``apply`` without ending a shape guard: how the guard switches plans."""
    _check_plan(model, plan)
    current = _INSTALLED.get(model)
    if current is not None:
        if current.plan == plan:
            return model
        _INSTALLED.pop(model, None)
        _restore(current)
    specs = _specs(model, plan)  # validates everything before the model is touched
    installed = _Installed(plan, [], specs)
    try:
        for spec in specs.values():
            module = spec.module
            had_own = "forward" in module.__dict__
            installed.modules.append((module, had_own, module.__dict__.get("forward")))
            module.forward = make_wrapper(spec, specs)
        # [shapes #9] a shape guard checks calls in the root wrapper: install it then too
        if shape_guard.guards(model) or any(isinstance(item, Segment) for item in plan.items):
            had_own = "forward" in model.__dict__
            installed.modules.append((model, had_own, model.__dict__.get("forward")))
            model.forward = make_root_guard(model.forward)
    except BaseException:
        _restore(installed)
        raise
    _INSTALLED[model] = installed
    if dynamo.loaded():
        prepare_for_compile(model)
    return model


def prepare_for_compile(model: nn.Module) -> nn.Module:
    """Make the installed forwards that open regions opaque to Dynamo (imports it).

    A compiled caller then graph-breaks at each region's call instead of tracing
    into the wrapper (which it would, correctly but with a recompile per unit);
    kept units stay traceable. ``apply`` does this itself when Dynamo is already
    loaded; ``gradckpt.integrations.compile.compile_model`` calls it.
    """
    installed = _INSTALLED.get(model)
    if installed is None:
        return model
    for spec in installed.units.values():
        forward = spec.module.__dict__.get("forward")
        opens_regions = spec.mode != "keep" or bool(spec.segments)
        if opens_regions and forward is not None and not hasattr(forward, "_torchdynamo_disable"):
            spec.module.forward = dynamo.opaque(forward)
    guard = getattr(model.__dict__.get("forward"), "__gradckpt_guard__", None)
    if guard is not None:
        # Skip only the guard's own frame: the model's forward still compiles.
        skipped = dynamo.opaque(guard, recursive=False)
        skipped.__gradckpt_original__ = model.forward.__gradckpt_original__
        model.forward = skipped
    return model


def _refuse_segments_under_fsdp(model: nn.Module, plan: Plan) -> None:
    modules = dict(model.named_modules())

    def visit(items: tuple) -> None:
        for item in items:
            if isinstance(item, Segment):
                for path in item.paths:
                    module = modules.get(path)
                    sharded = fsdp_sharded(module) if module is not None else None
                    if sharded is not None:
                        name = f"segment[{item.paths[0]}..{item.paths[-1]}]"
                        raise ValueError(
                            segment_error(name, ".".join(x for x in (path, sharded) if x))
                        )
                visit(item.items)

    visit(plan.items)


def _restore(installed: _Installed) -> None:
    for module, had_own, previous in reversed(installed.modules):
        if had_own:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: the model runs exactly as before it was applied.

    Example:
        >>> gradckpt.remove(model)
    """
    shape_guard.forget(model)
    installed = _INSTALLED.pop(model, None)
    if installed is not None:
        _restore(installed)
    return model
