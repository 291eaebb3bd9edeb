"""A planned model made ready for ``torch.compile``: regions opaque, kept units wrapped.

Example:
    >>> prepare_for_compile(model)  # a compiled caller graph-breaks at each region
"""

from __future__ import annotations

from torch import nn

from gradckpt.apply.installed import installed_on
from gradckpt.apply.wrappers import RootGuard, UnitForward, make_opaque, make_wrapper

__all__ = ["prepare_for_compile", "wrap_unit"]


def prepare_for_compile(model: nn.Module) -> nn.Module:
    """Make the installed forwards that open regions opaque to Dynamo (imports it).

    A compiled caller then graph-breaks at each region's call instead of tracing
    into the wrapper (which it would, correctly but with a recompile per unit);
    kept units stay traceable. ``apply`` does this itself when Dynamo is already
    loaded; ``gradckpt.compiled.around_regions.compile_model`` calls it.
    """
    installed = installed_on(model)
    if installed is None:
        return model
    for spec in installed.units.values():
        forward = spec.module.__dict__.get("forward")
        opens_regions = spec.handler.opens_region or bool(spec.segments)
        if opens_regions and isinstance(forward, UnitForward):
            make_opaque(forward)
    guard = model.__dict__.get("forward")
    if isinstance(guard, RootGuard):
        make_opaque(guard)  # skips only the guard's own frame: the model's forward compiles
    return model


def wrap_unit(model: nn.Module, path: str) -> None:
    """Install the wrapper of a unit that runs without one (``apply._runs_plainly``).

    ``compile_model`` gives such a unit a compiled body, which only a wrapper runs.
    Removed with the plan, as the others are.
    """
    installed = installed_on(model)
    if installed is None or path not in installed.units:
        raise ValueError(f"wrap_unit: {path!r} is not a unit of the plan applied to the model")
    spec = installed.units[path]
    if any(module is spec.module for module, _, _ in installed.modules):
        return
    wrapper = make_wrapper(spec, installed.units, segmented=False)
    guard = model.__dict__.get("forward")
    wrapper.root = guard if isinstance(guard, RootGuard) else None
    installed.modules.append((spec.module, "forward" in spec.module.__dict__,
                              spec.module.__dict__.get("forward")))  # fmt: skip
    installed.installed.append(wrapper)
    spec.module.forward = wrapper
