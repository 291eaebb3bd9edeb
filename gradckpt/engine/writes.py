"""Writes a region makes to state that existed before it, and how its recompute undoes them.

A recompute reruns the region's ops, in-place writes included: a BatchNorm
updates its running statistics again, a counter buffer counts twice
(pytorch#96136). The engine keeps such module side effects to once per step
in one of two ways:

* **per op** (:class:`~gradckpt.engine.modes.RecomputeMode`): the recompute
  runs under a dispatch mode that aims every write to a tensor the recompute
  did not create at a copy. It sees every op, so it needs nothing known ahead,
  and it costs a Python call per op;
* **per region** (:class:`StateWatch`, the lean path): the region knows the
  modules whose buffers its code may write to (:func:`module_state`). The
  forward notes which buffers it changed; the recompute runs with the
  saved-tensor hooks alone, as torch's checkpoint does, and puts those buffers
  back as the forward left them. It costs nothing per op: a walk over the
  modules' buffers and two version reads each per region, and a copy of each
  buffer the forward changed.

A buffer changed if its version counter moved, except the running statistics
that batch-norm kernels update without moving it (their schemas do not declare
the write): ``running_mean`` and ``running_var`` of a module in training mode
count as changed. The per-region way covers the buffers of the region's
modules (what module side effects are); a write to a tensor outside them (a
plain tensor attribute, a global) is repeated by a lean recompute, as by
torch's. Regions whose modules are unknown (a function that is not a module or
a module's method) recompute per op.

Example:
    >>> watch = StateWatch(lambda: [block])
    >>> watch.begin(); y = block(x); watch.end()
    >>> with watch.restoring():  # the recompute
    ...     block(x)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["StateWatch", "module_state"]

#: The modules whose buffers a region may write to (their submodules' too).
StateFn = Callable[[], Iterable[nn.Module]]

# Written in place by the batch-norm kernels without a version bump (see modes.py).
_SILENT_WRITES = ("running_mean", "running_var")


def module_state(fn: Any) -> StateFn | None:
    """The module ``fn`` is or is a method of, as a region's state; else None.

    Example:
        >>> module_state(block) is not None, module_state(lambda x: x) is None
        (True, True)
    """
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    return (lambda: (owner,)) if isinstance(owner, nn.Module) else None


def _buffers(modules: Iterable[nn.Module]) -> list[tuple[torch.Tensor, int, bool]]:
    """Each buffer once, with its version and whether a kernel may write it silently."""
    found: dict[int, tuple[torch.Tensor, int, bool]] = {}
    stack = list(modules)
    seen: set[int] = set()
    while stack:  # a walk of its own: named_buffers() costs three times as much
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, b in module._buffers.items():
            if b is not None and id(b) not in found:
                silent = module.training and name in _SILENT_WRITES
                found[id(b)] = (b, b._version, silent)
        stack.extend(module._modules.values())
    return list(found.values())


class StateWatch:
    """Which buffers of a region's modules its forward changed, restored after each recompute."""

    __slots__ = ("_versions", "mutated", "state")

    def __init__(self, state: StateFn) -> None:
        self.state = state
        self._versions: list[tuple[torch.Tensor, int, bool]] = []
        self.mutated: list[torch.Tensor] = []

    def begin(self) -> None:
        """The forward starts: note the versions of the buffers."""
        self._versions = _buffers(self.state())

    def end(self) -> None:
        """The forward ended: what it wrote to, the recompute must leave as it is now."""
        self.mutated = [t for t, v, silent in self._versions if silent or t._version != v]
        self._versions = []

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """Run a recompute, then put back what the forward wrote to (its values now)."""
        if not self.mutated:
            yield
            return
        kept = [(t, t.detach().clone()) for t in self.mutated]
        try:
            yield
        finally:
            with torch.no_grad():
                for t, value in kept:
                    t.copy_(value)
