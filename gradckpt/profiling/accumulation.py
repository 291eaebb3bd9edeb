"""Gradient accumulation between backward nodes, done as the plain step does it.

When two backward nodes send a gradient to the same input, autograd's engine
adds them in its input buffer: in place (``old.add_(new)``) when it holds the
only reference to ``old`` and its storage, else out of place (``old + new``, one
more gradient-sized block for a moment). Under any ``TorchDispatchMode`` it
always takes the out-of-place branch (``isTensorSubclassLike`` is true while a
mode is active), and the profiler's storage watcher holds each storage's Python
object, which raises the storage's use count too. So a recorded step allocated
a block per accumulation that the plain step never does: on transformers' Mamba
(its reference scan sums 64 per-step slices of one large gradient) the
recorded peak read 7.7% over the plain step's allocator peak.

The recorder therefore redoes the engine's choice itself. :func:`node_boundaries`
marks the stretch between a node's post-hook and the next node's pre-hook,
where the engine accumulates into its input buffers: an ``aten.add.Tensor``
seen there is that accumulation. :class:`InPlaceCheck` tells whether the plain
step would have added in place: a plain dense tensor (or a fake one: a fake
profile predicts the real step) whose reference counts are those of an
exclusively held buffer entry, the baseline read once per process from a graph
whose accumulation is known to be in place (the counts include references the
dispatch path itself holds, which vary with torch's version). Then the recorder
runs ``old.add_(new)`` and returns ``old``: the same values, and nobody else
holds ``old`` to see the change.

Conservative where unsure: a gradient that is not contiguous, or any count off
the baseline, keeps the out-of-place add (the prediction stays on the high
side). Tensor hooks of the step's own (``register_hook``) also run in that
stretch; an add they make is changed only if its first operand is held by
nobody else, which is what makes the change invisible.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

__all__ = ["InPlaceCheck", "graph_nodes", "node_boundaries"]


def graph_nodes(root: Any) -> list[Any]:
    """Every autograd node reachable from ``root`` (a ``grad_fn``), each once."""
    seen: set[Any] = set()
    stack = [root]
    out = []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return out


class _Flag:
    __slots__ = ("between",)

    def __init__(self) -> None:
        self.between = False


@contextlib.contextmanager
def node_boundaries(loss: torch.Tensor, flag: Any) -> Iterator[None]:
    """Set ``flag.between`` from each node's post-hook to the next node's pre-hook.

    Nodes' pre- and post-hooks do not change what the engine does (checked:
    the plain step's allocator peak is the same with them).
    """
    handles = []

    def after(grad_inputs: Any, grad_outputs: Any) -> None:
        flag.between = True

    def before(grad_outputs: Any) -> None:
        flag.between = False

    try:
        if loss.grad_fn is not None:
            for node in graph_nodes(loss.grad_fn):
                handles.append(node.register_hook(after))
                handles.append(node.register_prehook(before))
        yield
    finally:
        flag.between = False
        for handle in handles:
            handle.remove()


def _counts(t: torch.Tensor) -> tuple[int, int]:
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class InPlaceCheck:
    """Whether the plain step's engine would accumulate into ``old`` in place."""

    _baselines: ClassVar[dict[type, tuple[int, int] | None]] = {}

    @classmethod
    def prepare(cls) -> None:
        """Measure the baselines (once per process), before the pass they serve.

        Not lazily inside a pass: measuring runs a small backward, which inside
        the engine's own backward would see other counts.
        """
        if not cls._baselines:
            cls._baselines[torch.Tensor] = _measure_baseline(fake=False)
            cls._baselines[_fake_tensor_type()] = _measure_baseline(fake=True)

    @classmethod
    def baseline(cls, kind: type = torch.Tensor) -> tuple[int, int] | None:
        """Reference counts of an exclusively held buffer entry of ``kind``, seen from a mode.

        ``kind``: ``torch.Tensor``, or ``FakeTensor`` (fake profiles predict the
        real step, which accumulates in place); None for any other subclass.
        """
        cls.prepare()
        return cls._baselines.get(kind)

    @classmethod
    def applies(cls, func: Any, args: tuple, kwargs: dict) -> bool:
        """``func(*args, **kwargs)`` is an accumulation the plain step does in place."""
        if func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2:
            return False
        old, new = args
        if type(old) is not type(new) or not isinstance(old, torch.Tensor):
            return False
        if old.layout != torch.strided or new.layout != torch.strided or old.is_nested:
            return False
        if old.shape != new.shape or old.dtype != new.dtype:
            return False
        if old.device != new.device or old.storage_offset() != 0 or not _dense(old):
            return False
        baseline = cls.baseline(type(old))
        return baseline is not None and _counts(old) == baseline


def _fake_tensor_type() -> type:
    from torch._subclasses.fake_tensor import FakeTensor  # imported when profiling only

    return FakeTensor


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense covering its whole storage (what the engine requires)."""
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _measure_baseline(*, fake: bool) -> tuple[int, int] | None:
    # A graph whose accumulation the engine does in place (_probe_step): y's
    # gradient is the sum of sin's and cos's, two fresh tensors nobody else holds.
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from gradckpt.measure.storages import StorageWatcher

    seen: list[tuple[int, int]] = []
    flag = _Flag()

    class Probe(TorchDispatchMode):
        # Holds what RecordMode holds: each output's storage, through the watcher.
        def __init__(self) -> None:
            super().__init__()
            self.watcher = StorageWatcher()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if flag.between and func is torch.ops.aten.add.Tensor and not seen:
                seen.append(_counts(args[0]))
            out = func(*args, **kwargs)
            self.watcher.observe(func, out)
            return out

    # Outside any mode the caller is in; under a fresh FakeTensorMode for fake tensors.
    with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            outer: Any = FakeTensorMode()
        else:
            outer = contextlib.nullcontext()
        with outer:
            x = torch.ones(4, requires_grad=True)
            with Probe():
                _probe_step(x, flag)
    return seen[0] if seen else None  # None: this torch accumulates elsewhere


def _probe_step(x: torch.Tensor, flag: _Flag) -> None:
    y = x * 2
    loss = (y.sin() + y.cos()).sum()
    with node_boundaries(loss, flag):
        loss.backward()
