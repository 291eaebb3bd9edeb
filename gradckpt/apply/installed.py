"""What ``apply`` installed on a model: the record it keeps in the model's ``__dict__``.

The record lives on the model itself (not in a registry keyed by the model), so
a deepcopy or an unpickled copy carries its own, pointing at its own modules,
and ``remove`` works on it. Layers above read the applied plan and its units
here and register what ``remove`` must put back.

Example:
    >>> applied_plan(model).summary()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gradckpt.apply.specs import UnitSpec
from gradckpt.planning.plans.plan import Plan

__all__ = ["applied_plan", "applied_units", "installed_on", "on_remove", "restamp_plan"]


@dataclass
class _Installed:
    """A plan's installation: its units, the forwards put on modules, what to put back."""

    plan: Plan
    modules: list[tuple[nn.Module, bool, object]]  # module, had own forward, previous forward
    units: dict[str, UnitSpec]
    # The forward installed per ``modules`` entry (a unit's, a shared module's calls',
    # the root guard, a chunked MLP's).
    installed: list[Any] = field(default_factory=list)
    undo: list[Callable[[], None]] = field(default_factory=list)  # settings to put back


_STATE = "_gradckpt_installed"


def installed_on(model: nn.Module) -> _Installed | None:
    """The record of what ``apply`` installed on ``model``, or None."""
    found = model.__dict__.get(_STATE) if isinstance(model, nn.Module) else None
    return found if isinstance(found, _Installed) else None


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan installed on ``model`` by :func:`apply`, or None."""
    installed = installed_on(model)
    return installed.plan if installed is not None else None


def restamp_plan(model: nn.Module, plan: Plan) -> None:
    """Record ``plan`` as the installed one: the same decisions, other measured fields.

    ``fit(..., compile=True)`` learns the compiled peak only after installing.
    """
    installed = installed_on(model)
    if installed is None or installed.plan.items != plan.items:
        raise ValueError("restamp_plan: the model does not run this plan's decisions")
    installed.plan = plan


def applied_units(model: nn.Module) -> dict[str, UnitSpec]:
    """The installed units of ``model`` by path (empty if no plan is applied).

    Layers above adjust them in place (``gradckpt.compiled.around_regions`` sets
    their compiled bodies); they live until the plan is removed or replaced.
    """
    installed = installed_on(model)
    return installed.units if installed is not None else {}


def on_remove(model: nn.Module, undo: Callable[[], None]) -> None:
    """Have :func:`remove` call ``undo`` (integrations put back settings made for the plan).

    ``undo`` lives with the applied plan on the model, so it must copy and
    pickle with it (a module-level function or a small object, not a closure).

    Example:
        >>> on_remove(model, RestoreCache(configs))
    """
    installed = installed_on(model)
    if installed is None:
        raise ValueError("on_remove: no plan is applied to this model")
    installed.undo.append(undo)
