"""What ``apply`` builds from a plan for its wrappers: unit and segment specs, policies.

These objects live on the applied model (each unit's wrapper holds its spec),
so they copy and pickle with it: a deepcopy or an unpickled model gets specs
pointing at its own modules. A unit's plain forward is kept so that pickle
stores the class's method by name (:func:`portable`), not the instance
attribute ``forward`` (which is the wrapper itself).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gradckpt.engine import dynamo
from gradckpt.engine.decisions import KEEP, Decision
from gradckpt.planning.handlers.registry import KindHandler, handler_for
from gradckpt.planning.kinds.selective import PlanPolicy

__all__ = [
    "PlanPolicy",
    "SegmentSpec",
    "UnitSpec",
    "call_in_region",
    "fsdp_sharded",
    "plan_policy",
    "portable",
    "rebound",
    "segment_error",
]

_FSDP_CLASSES = ("FSDPModule", "FullyShardedDataParallel")


def fsdp_sharded(module: nn.Module) -> str | None:
    """The path of a submodule of ``module`` that FSDP shards (itself: ""), or None.

    Such a module's parameters are gathered only around its own forward and
    backward, so a segment (one region over several units, recomputed during
    its last unit's backward) cannot rerun it. Recognized by class name, so
    ``torch.distributed`` is never imported here.
    """
    if not _sharding_possible():
        return None
    stack = [module]
    while stack:  # a plain walk first: segments run this at every forward
        m = stack.pop()
        if _sharding_class(type(m)):
            break
        stack.extend(c for c in m._modules.values() if c is not None)
    else:
        return None
    return next(path for path, m in module.named_modules() if _sharding_class(type(m)))


def _sharding_possible() -> bool:
    """FSDP shards only within an initialized process group: without one, nothing to walk."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


_SHARDING: dict[type, bool] = {}  # module class -> whether it is (a subclass of) FSDP's


def _sharding_class(cls: type) -> bool:
    found = _SHARDING.get(cls)
    if found is None:
        found = _SHARDING[cls] = any(
            c.__name__ in _FSDP_CLASSES and c.__module__.startswith("torch.distributed")
            for c in cls.__mro__
        )
    return found


def segment_error(name: str, path: str) -> str:
    return (
        f"gradckpt: {name} spans {path}, which FSDP shards. A segment recomputes all its "
        "units during its last unit's backward, when FSDP holds the others' parameters "
        "sharded. Plan with segments=False (gradckpt.plan(..., segments=False), or "
        "gradckpt.integrations.distributed.plan_for_fsdp) before fully_shard."
    )


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
    """What a unit's wrapper needs: its decision and the segments enclosing it."""

    path: str
    module: nn.Module
    plain: Callable[..., Any]
    decision: Decision = KEEP
    policy: Callable[..., Any] | None = None
    segments: list[SegmentSpec] = field(default_factory=list)  # outermost first
    expected_shape: tuple[int, ...] | None = None
    compiled: Callable[..., Any] | None = None  # a torch.compile'd ``plain``, if any
    runtime: Any = None  # what the decision's kind installed for this plan (KindHandler.install)

    @property
    def handler(self) -> KindHandler:
        """What the unit's decision kind does (see :mod:`gradckpt.planning.kinds`)."""
        return handler_for(self.decision)

    @property
    def mode(self) -> str:
        """The decision's kind name."""
        return self.decision.kind

    @property
    def body(self) -> Callable[..., Any] | None:
        """The compiled body this unit runs in regions, or None (runs ``plain`` eagerly)."""
        return self.compiled if self.handler.compiled_body else None

    def call_in_region(self, args: tuple, kwargs: dict) -> Any:
        """Run the unit inside a region (forward or recompute): the same way both times."""
        return call_in_region(self, args, kwargs)

    def modules(self) -> tuple[nn.Module]:
        """The module whose buffers the unit may write (a region's ``state``)."""
        return (self.module,)

    def __getstate__(self) -> dict[str, Any]:
        # A compiled body closes over the original module: a copy (deepcopy,
        # pickle) runs its own module eagerly until it is compiled again.
        return {**self.__dict__, "plain": portable(self.plain), "compiled": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, plain=rebound(state["plain"]))


class _ClassMethodOf:
    """Stands for ``type(owner).<name>`` bound to ``owner`` while a model is copied."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner = owner
        self.name = name


def portable(fn: Callable[..., Any]) -> Any:
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


def rebound(fn: Any) -> Callable[..., Any]:
    if isinstance(fn, _ClassMethodOf):
        return getattr(type(fn.owner), fn.name).__get__(fn.owner)
    return fn


def call_in_region(unit: UnitSpec, args: tuple, kwargs: dict) -> Any:
    """Run the unit inside a region (forward or recompute): the same way both times."""
    if unit.body is not None:
        return unit.body(*args, **kwargs)
    with dynamo.eager():
        return unit.plain(*args, **kwargs)
