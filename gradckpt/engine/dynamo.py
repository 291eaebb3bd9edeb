"""How regions meet ``torch.compile`` (Dynamo).

A region is only correct if its recompute saves, in the same order, the same
tensors as its forward did. Compiled code saves what the AOT partitioner
chose; the same code run eagerly saves what eager autograd chose. So a region
must run its body the same way twice, and there are two ways to do that:

* **eager regions** (the default): the region's entry points are opaque to
  Dynamo (:func:`opaque`: a graph break when a compiled caller reaches them),
  and the forward runs under the ``force_eager`` stance (:func:`eager`), so
  even an explicitly compiled callable inside it runs eagerly, as it will in
  the recompute, where the engine's own dispatch mode makes Dynamo fall back
  to eager anyway.
* **compiled regions** (``Frame(compiled=True)``): the body calls a compiled
  callable in the forward and again in the recompute; the recompute then runs
  without the engine's dispatch mode (Dynamo would skip compiled code under
  it). What that mode did for eager regions is done otherwise: kept op outputs
  do not exist (compiled regions take no policy) and writes to pre-existing
  state (BatchNorm running statistics) are undone by restoring the tensors the
  forward mutated. :func:`eager_reason` says whether compiled code would run
  now, so a frame can record how its forward ran and replay exactly that.

Nothing here imports Dynamo unless the program already did: without Dynamo
loaded no compiled code exists, and ``import gradckpt`` stays light.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["eager", "eager_reason", "frames_watched", "is_compiling", "loaded", "opaque"]


def loaded() -> bool:
    """Whether Dynamo was imported (only then can compiled code exist)."""
    return "torch._dynamo" in sys.modules


def is_compiling() -> bool:
    """True while Dynamo traces the calling code (never at run time)."""
    return torch.compiler.is_compiling()


def frames_watched() -> bool:
    """True while Dynamo traces or watches new Python frames here (a compiled caller runs).

    Outside both, a Dynamo-disabled wrapper is pure cost: plain eager code may call
    the function itself.
    """
    if not loaded():
        return False
    if torch.compiler.is_compiling():
        return True
    return torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False)


def opaque(fn: Callable[..., Any], recursive: bool = True) -> Callable[..., Any]:
    """``fn`` made opaque to Dynamo (``torch.compiler.disable``), created once.

    Call it only from a branch taken while tracing (Dynamo is loaded then):
    a traced call becomes a graph break, and ``fn`` runs eagerly. With
    ``recursive=False`` only ``fn``'s own frame is skipped; what it calls is
    still compiled.
    """
    # Kept on the function itself (a global cache would keep every wrapped
    # model alive).
    attr = "__gradckpt_opaque__" if recursive else "__gradckpt_opaque_frame__"
    found = getattr(fn, attr, None)
    if found is None:
        found = torch.compiler.disable(fn, recursive=recursive)
        with contextlib.suppress(AttributeError, TypeError):
            setattr(fn, attr, found)
    return found


def eager() -> contextlib.AbstractContextManager[None]:
    """Run compiled callables eagerly inside the block (``force_eager`` stance).

    Entered by every region's forward and lean recompute: the stance is switched
    through Dynamo's own setter (about a microsecond) where this torch has it, not
    through ``torch.compiler.set_stance`` (about 15: a decorator-context object per
    call); nothing happens when the stance already is ``force_eager``.
    """
    if not loaded():
        return contextlib.nullcontext()
    frame = sys.modules.get("torch._dynamo.eval_frame")
    setter = getattr(frame, "_set_stance", None)
    stance = getattr(frame, "_stance", None)
    make = getattr(frame, "DynamoStance", None)
    if setter is None or make is None or getattr(stance, "stance", None) is None:
        return _public_eager()
    if stance.stance == "force_eager":
        return contextlib.nullcontext()
    return _ForceEager(setter, make)


class _ForceEager:
    """The ``force_eager`` stance for a block, through Dynamo's own setter."""

    __slots__ = ("make", "prior", "setter")

    def __init__(self, setter: Callable[[Any], Any], make: Callable[[str], Any]) -> None:
        self.setter, self.make, self.prior = setter, make, None

    def __enter__(self) -> None:
        try:
            self.prior = self.setter(self.make("force_eager"))
        except RuntimeError:
            # Inside a frame Dynamo is evaluating (a graph break reached us without an
            # opaque entry point): the stance cannot change here. Compiled code reached
            # from here then runs compiled; the determinism check catches a forward and
            # recompute that differ.
            self.prior = None

    def __exit__(self, *exc: object) -> None:
        if self.prior is not None:
            self.setter(self.prior)


@contextlib.contextmanager
def _public_eager() -> Iterator[None]:
    try:
        stance = torch.compiler.set_stance("force_eager")
    except RuntimeError:  # inside a frame Dynamo is evaluating (see _ForceEager)
        yield
        return
    with stance:
        yield


def eager_reason() -> str | None:
    """Why compiled code called now would run eagerly, or None if it would compile/run compiled.

    Mirrors Dynamo's own checks: Dynamo disabled by config, the ``force_eager``
    stance, or a TorchDispatchMode on the stack (Dynamo skips frames under
    modes that do not declare ``ignore_compile_internals``).
    """
    if not loaded():
        return "Dynamo is not loaded"
    import torch._dynamo

    if torch._dynamo.config.disable:
        return "torch._dynamo.config.disable is set"
    stance = getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")
    if stance == "force_eager":
        return 'the compiler stance is "force_eager"'
    from torch.utils import _python_dispatch as dispatch

    check = getattr(dispatch, "any_torch_dispatch_mode_on_stack", None)
    walks_stack = getattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile", True)
    if check is not None and walks_stack:
        blocked = check()
    else:
        blocked = dispatch.is_in_any_mode_without_ignore_compile_internals()
    if blocked:
        return "a TorchDispatchMode is active (torch.compile runs eagerly under it)"
    return None
