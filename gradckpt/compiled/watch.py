"""Dynamo's (re)compiles of a compiled model, counted per call and reported.

A compiled model recompiles when a call fails the guards of every graph
Dynamo holds for a frame: a new input shape (before Dynamo marks the
dimension dynamic), a plan switched by the shape guard (other wrappers are
installed, so other code is traced), a changed flag. Each costs a compile
(seconds to minutes with inductor) and, past ``torch._dynamo.config.
recompile_limit``, Dynamo falls back to eager silently. So
:func:`gradckpt.compile` watches the model's compiled calls: every frame
Dynamo compiles during one is counted (Dynamo's compile-start callback, which
names the compile ``frame/attempt``; an attempt above 0 is a recompile of a
frame compiled before), and a call that recompiled warns once per input
shape. :func:`compile_stats` reads the counts; ``gradckpt.shape_stats`` shows
the recompiles of a ``fit(..., compile=True)`` model next to its re-plans.

Compiles of the backward graph (lazy, during ``backward``) are not counted:
they follow the forward's, outside the model's call.

Example:
    >>> gradckpt.fit(model, loss_fn, "300MB", compile=True)
    >>> ...  # train on varying lengths
    >>> compile_stats(model).recompiles
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gradckpt.planning.plans.planset import shape_key

__all__ = ["CompileStats", "compile_stats", "unwatch", "watch"]


@dataclass(frozen=True)
class CompileStats:
    """Dynamo frame compiles during a compiled model's calls.

    ``compiles`` counts every frame compiled (the first call's included);
    ``recompiles`` those of a frame compiled before (its guards failed);
    ``shapes`` the input shapes of the calls that recompiled, in order.

    Example:
        >>> print(compile_stats(model).summary())
    """

    calls: int
    compiles: int
    recompiles: int
    shapes: tuple[str, ...]

    def summary(self) -> str:
        """One line, e.g. for a training log."""
        where = f" (calls at {'; '.join(self.shapes)})" if self.shapes else ""
        return (
            f"gradckpt compiled: {self.compiles} frame compile(s) over {self.calls} call(s), "
            f"{self.recompiles} recompile(s){where}"
        )


@dataclass(eq=False)
class _Watch:
    calls: int = 0
    compiles: int = 0
    recompiles: int = 0
    shapes: list[str] = field(default_factory=list)

    def stats(self) -> CompileStats:
        return CompileStats(self.calls, self.compiles, self.recompiles, tuple(self.shapes))


_WATCHES: weakref.WeakKeyDictionary[nn.Module, _Watch] = weakref.WeakKeyDictionary()
_RUNNING = threading.local()  # the watches of the compiled calls running on this thread


def _on_compile_start(args: Any) -> None:
    from torch._dynamo.callback import CallbackTrigger

    running = getattr(_RUNNING, "stack", None)
    if not running or args.callback_trigger != CallbackTrigger.DYNAMO:
        return
    watch = running[-1]  # the innermost compiled model's call owns the frame
    watch.compiles += 1  # once per compile: Dynamo's restarts happen inside it
    attempt = args.compile_id.rsplit("/", 1)[-1]
    if attempt.isdigit() and int(attempt) > 0:
        watch.recompiles += 1


def _register() -> None:
    # Checked at each call: torch._dynamo.reset() clears the callbacks.
    import torch._dynamo

    handler = torch._dynamo.callback_handler
    if _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)


def watch(model: nn.Module) -> Callable[[], CompileStats]:
    """Count the compiles of ``model``'s compiled calls (after ``model.compile``); in place.

    Returns a callable giving the stats so far. Calling it again on the same
    model keeps the counts.

    Example:
        >>> model.compile(); stats = watch(model); model(x); stats().compiles
    """
    compiled = model._compiled_call_impl
    if compiled is None:
        raise ValueError("watch: the model is not compiled (call model.compile() first)")
    _register()
    state = _WATCHES.setdefault(model, _Watch())

    def call(*args: Any, **kwargs: Any) -> Any:
        _register()
        state.calls += 1
        before = state.recompiles
        stack = _RUNNING.__dict__.setdefault("stack", [])
        stack.append(state)
        try:
            return compiled(*args, **kwargs)
        finally:
            stack.pop()
            if state.recompiles > before:
                _report(state, state.recompiles - before, args, kwargs)

    call.__wrapped__ = compiled  # type: ignore[attr-defined]
    model._compiled_call_impl = call
    return state.stats


def _report(state: _Watch, new: int, args: tuple, kwargs: dict) -> None:
    shape = shape_key(args, kwargs).describe()
    state.shapes.append(shape)
    if shape in state.shapes[:-1]:
        return  # warned for this shape already
    warnings.warn(
        f"gradckpt.compile: the call with inputs {shape} made torch._dynamo recompile "
        f"{new} frame(s) ({state.recompiles} so far). Each recompile costs a compile, and "
        "past torch._dynamo.config.recompile_limit Dynamo runs the frame eagerly. Pad to "
        "few shapes, or compile with dynamic=True; gradckpt.compile_stats(model) counts them.",
        stacklevel=3,
    )


def compile_stats(model: nn.Module) -> CompileStats | None:
    """The compiles Dynamo made during ``model``'s compiled calls, or None if not watched.

    Example:
        >>> gradckpt.compile(model, loss_fn); loss_fn().backward()
        >>> compile_stats(model).recompiles
    """
    state = _WATCHES.get(model)
    return state.stats() if state is not None else None


def unwatch(model: nn.Module) -> None:
    """Forget ``model``'s counts (its compiled call is gone: ``fit`` gave its compile up)."""
    _WATCHES.pop(model, None)
