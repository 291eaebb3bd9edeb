"""What a region keeps of its inputs, and how it hands them to its recompute.

Tensors are kept by reference, other values as they are. A region opened
outside any recompute saves its tensors through autograd (an enclosing
``saved_tensors_hooks`` such as ``save_on_cpu`` then applies to them, and an
in-place change is caught by autograd's version check); one opened inside an
enclosing recompute keeps plain references and checks versions itself, since
saving through autograd there would add entries to the enclosing region's
sequence of saved tensors.

The recompute gets each input that takes no gradient as the object itself (a
frozen ``nn.Parameter`` with its Python attributes: the quantization state of
QLoRA weights), as torch does; each one that takes a gradient as a fresh leaf,
so the recompute's graph stays apart from the forward's.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KeptInputs"]

_TENSOR_SLOT = object()  # marks where a tensor goes in the input template


class _SaveInputs(torch.autograd.Function):
    """Saves a region's tensor inputs through autograd (see the module docstring)."""

    @staticmethod
    def forward(ctx, dummy, *tensors):
        ctx.save_for_backward(*tensors)
        return dummy.new_empty((0,))

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - never part of a real backward
        return (None,) * (1 + len(ctx.saved_tensors))


class KeptInputs:
    """The flattened inputs of one region, kept for its recompute.

    Example:
        >>> kept = KeptInputs([x, 3, w], nested=False)
        >>> args = kept.get()  # [fresh leaf of x, 3, w itself (no grad)]
    """

    def __init__(self, flat_inputs: list[Any], *, nested: bool) -> None:
        tensors = [x for x in flat_inputs if isinstance(x, torch.Tensor)]
        self._template = [_TENSOR_SLOT if isinstance(x, torch.Tensor) else x for x in flat_inputs]
        self._requires_grad = [t.requires_grad for t in tensors]
        self._node: Any = None
        self._plain: list[torch.Tensor] = []
        self._versions: list[int] = []
        if not nested:
            dummy = torch.empty((0,), requires_grad=True)
            self._node = _SaveInputs.apply(dummy, *tensors).grad_fn
        else:
            self._plain = [t.detach() if t.requires_grad else t for t in tensors]
            self._versions = [t._version for t in tensors]

    def get(self) -> list[Any]:
        """The inputs for one recompute, in the order they were given."""
        if self._node is not None:
            tensors = list(self._node.saved_tensors)
        else:
            for t, version in zip(self._plain, self._versions):
                if t._version != version:
                    raise RuntimeError(
                        "an input of a checkpointed region was modified in place after the "
                        "region ran; its recompute would see different values. Clone the "
                        "tensor before changing it."
                    )
            tensors = self._plain
        found = iter(tensors)
        takes_grad = iter(self._requires_grad)
        out = []
        for x in self._template:
            if x is _TENSOR_SLOT:
                t = next(found)
                out.append(t.detach().requires_grad_(True) if next(takes_grad) else t)
            else:
                out.append(x)
        return out
