"""What a profiled step may change, snapshotted on entry, reset before each pass, restored at the end.

The step is ``loss_fn().backward()``, and ``loss_fn`` may reach past the
model: a loss head of its own (with a BatchNorm), a learnable prompt, an
input that requires grad. So the state covered is

* the model's parameters' gradients and its buffers;
* the gradient of every leaf tensor the step's autograd graph reaches
  (collected from the graph before its backward runs);
* the buffers of every module called during the step, in or outside the model
  (seen by a global forward pre-hook, on the profiling thread only);
* torch's CPU and CUDA RNG states.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["StepState"]


class StepState:
    """Snapshot of gradients, buffers and RNG a profiled step may touch.

    Example:
        >>> state = StepState(model)
        >>> with state.watching_modules():
        ...     state.reset(); loss = loss_fn(); state.adopt_graph(loss); loss.backward()
        >>> state.restore()
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = list(model.parameters())
        self.grads = [p.grad for p in self.params]
        self.leaves: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # outside the model
        self._known_leaves = {id(p) for p in self.params}
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self._known_buffers = {id(b) for b in model.buffers()}
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )

    def adopt_graph(self, loss: torch.Tensor) -> None:
        """Take over the gradients of the leaves ``loss``'s graph reaches (call before backward)."""
        for leaf in _graph_leaves(loss):
            if id(leaf) not in self._known_leaves:
                self._known_leaves.add(id(leaf))
                self.leaves.append((leaf, leaf.grad))
                leaf.grad = None

    def _adopt_buffers(self, module: nn.Module) -> None:
        new = [b for b in module.buffers() if id(b) not in self._known_buffers]
        if not new:
            return
        # Copied outside the recorder's dispatch mode: the copy is not part of the step.
        with _disable_current_modes(), torch.no_grad():
            for buffer in new:
                self._known_buffers.add(id(buffer))
                self.buffers.append((buffer, buffer.detach().clone()))

    @contextlib.contextmanager
    def watching_modules(self) -> Iterator[None]:
        """Snapshot the buffers of every module this thread calls, before it first runs."""
        thread = threading.get_ident()

        def seen(module: nn.Module, args: Any) -> None:
            if threading.get_ident() == thread:
                self._adopt_buffers(module)

        handle = nn.modules.module.register_module_forward_pre_hook(seen)
        try:
            yield
        finally:
            handle.remove()

    def reset(self) -> None:
        """No gradients, buffers and RNG as on entry: the state each pass starts from."""
        for p in self.params:
            p.grad = None
        for leaf, _ in self.leaves:
            leaf.grad = None
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore(self) -> None:
        """Everything exactly as on entry (the same gradient tensors, not copies)."""
        self.reset()
        for p, g in zip(self.params, self.grads):
            p.grad = g
        for leaf, g in self.leaves:
            leaf.grad = g


def _graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors whose gradients a backward from ``loss`` accumulates."""
    root = loss.grad_fn
    if root is None:
        return [loss] if loss.requires_grad else []
    leaves = []
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return leaves
