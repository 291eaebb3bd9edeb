"""Packages that are also the verb they are named after (``gradckpt.plan(...)``)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["make_callable"]


def make_callable(module_name: str, target: Callable[[], Callable[..., Any]]) -> None:
    """Let the package ``module_name`` be called as the function ``target()`` returns.

    DESIGN.md names both ``gradckpt.plan(model, loss_fn, budget)`` and
    ``gradckpt.plan.simulate(profile, plan)``: the package is the namespace of
    its layer and, called, its main verb (imported lazily to keep layers apart).
    """

    class CallablePackage(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return target()(*args, **kwargs)

    sys.modules[module_name].__class__ = CallablePackage
