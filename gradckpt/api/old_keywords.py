"""The keywords ``plan`` and ``fit`` took before their options were grouped, kept one release.

``fit(model, loss_fn, budget, repeats=1, seq_dim=2, optimizer=opt)`` still runs as
``fit(model, loss_fn, budget, profiling=ProfileOptions(repeats=1),
shapes=ShapeOptions(seq_dim=2), step=StepOptions(opt))``, with one
``DeprecationWarning`` naming the new form (not a ``FutureWarning``: the project's
tests turn those into errors). Delete this module, and its decorator on the verbs,
in the release after.

Example:
    >>> @accepts_old_keywords("repeats", "seq_dim")
    ... def plan(model, loss_fn, budget, *, shapes=None, profiling=None, step=None): ...
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from gradckpt.api.options import ProfileOptions, ShapeOptions, StepOptions

__all__ = ["accepts_old_keywords", "as_groups"]

Verb = TypeVar("Verb", bound=Callable[..., Any])

#: The grouped parameters and the values they take.
_GROUPS: dict[str, type] = {
    "shapes": ShapeOptions, "profiling": ProfileOptions, "step": StepOptions,
}  # fmt: skip
#: The grouped parameter each old keyword is now a field of.
_GROUP_OF = {
    name: group for group, kind in _GROUPS.items() for name in
    (f.name for f in dataclasses.fields(kind)) if name != "planned"
}  # fmt: skip


def accepts_old_keywords(*old: str) -> Callable[[Verb], Verb]:
    """Let the decorated verb take the keywords ``old`` (and ``shapes=`` as a list of
    shapes) as before, folded into its grouped options with a DeprecationWarning."""

    def decorate(verb: Verb) -> Verb:
        @functools.wraps(verb)
        def verb_with_old_keywords(*args: Any, **kwargs: Any) -> Any:
            if _listed(kwargs.get("shapes")) or any(name in kwargs for name in old):
                kwargs = _grouped(verb.__name__, old, kwargs)
            return verb(*args, **kwargs)

        return verb_with_old_keywords  # type: ignore[return-value]

    return decorate


def as_groups(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` given flat (``blocks=``, ``optimizer=``: as the trainer callbacks and the
    distributed helpers take them from their users) folded into the verbs' groups, merged
    into a group given too. No warning: the flat form is those callers' own.

    Example:
        >>> as_groups({"repeats": 1, "solver": "dp"})
        {'solver': 'dp', 'profiling': ProfileOptions(blocks=None, repeats=1, profile=None)}
    """
    options = dict(options)
    if _listed(options.get("shapes")):
        options["shapes"] = ShapeOptions(planned=options["shapes"])
    for name in [n for n in options if n in _GROUP_OF]:
        group = _GROUP_OF[name]
        current = options.get(group)
        current = current if current is not None else _GROUPS[group]()
        options[group] = dataclasses.replace(current, **{name: options.pop(name)})
    return options


def _listed(shapes: object) -> bool:
    """``shapes=`` in the old form: the shapes to plan themselves."""
    return shapes is not None and not isinstance(shapes, ShapeOptions)


def _grouped(verb: str, old: tuple[str, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(kwargs)
    fields: dict[str, dict[str, Any]] = {}
    said: list[str] = []
    if _listed(kwargs.get("shapes")):
        fields["shapes"] = {"planned": kwargs.pop("shapes")}
        said.append("shapes=[...]")
    for name in old:
        if name in kwargs:
            fields.setdefault(_GROUP_OF[name], {})[name] = kwargs.pop(name)
            said.append(f"{name}=")
    new = []
    for group, given in fields.items():
        kind = _GROUPS[group]
        current = kwargs.get(group)  # given too (a migration half done): the old ones join it
        kwargs[group] = dataclasses.replace(current, **given) if current else kind(**given)
        new.append(f"{group}=gradckpt.{kind.__name__}({', '.join(f'{k}=...' for k in given)})")
    warnings.warn(
        f"gradckpt.{verb}({', '.join(said)}) is deprecated and goes in the next release: "
        f"pass {', '.join(new)}",
        DeprecationWarning,
        stacklevel=3,
    )
    return kwargs
