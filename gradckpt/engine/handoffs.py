"""Edits autograd cannot see between the units of one region, caught before its recompute.

A region that spans several units (a planned segment) is recomputed by calling
the units again, each handed the previous one's recomputed output. Code that
runs *between* two units in the forward does not run again, so an edit of the
output there would be lost in the recompute. An ordinary in-place op bumps the
tensor's version counter and the segment refuses it when the next unit starts;
an edit through ``x.data`` (``x.data.mul_(2)``) or ``x.data = y`` leaves the
version alone, and the recompute silently hands the next unit the unedited
values: wrong gradients.

So :class:`Handoffs` fingerprints each handed-over tensor twice in the forward:
when the unit returns it and when the next unit receives it. The fingerprint
(:func:`bits_checksum`) is two sums, of the elements' bit patterns and of their
values, each in the tensor's own type (no temporary copy). Both are taken from
the forward's own data, so non-deterministic kernels cannot make them differ (a
check that compared with the recompute's values could not say that). The cost
is four reductions over each handed-over activation in the forward, with no
host sync on an accelerator; the comparison waits for the region's recompute
(one host sync per recompute), where it raises
:class:`~gradckpt.engine.holders.CheckpointError` before any wrong value is used.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.utils._python_dispatch import _disable_current_modes

from gradckpt.engine.holders import CheckpointError

__all__ = ["Handoffs", "bits_checksum"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_checksum(t: torch.Tensor) -> tuple[int, ...] | torch.Tensor | None:
    """Two sums over ``t`` that any edit of its values changes: its bits and its values.

    The first sum adds the elements' bit patterns as integers of the element's
    size, wrapping (exact, NaN-safe, the same for any layout or order); it
    catches a change of a few elements. A uniform scaling by a power of two
    moves every element's bits by the same step and can wrap to the same sum,
    so floating tensors add their values too (in their own type: the same tensor
    always sums the same way, and its bits are compared, so NaN matches NaN).
    Both sums run in the tensor's own type: summing into a wider type makes
    torch convert the whole tensor first, a transient two to eight times the
    activation's size.

    A tuple of Python ints for a CPU tensor (nothing stays allocated), else an
    int64 tensor of the sums on ``t``'s device (no host sync). None for what has
    no plain bits to read (fake, meta, sparse, quantized, subclass tensors).
    Runs outside every dispatch mode: trackers and op counters of the step must
    not see it.

    Example:
        >>> bits_checksum(torch.ones(3)) == bits_checksum(torch.ones(3))
        True
    """
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
        return None
    if t.device.type == "meta":
        return None
    with _outside_modes():
        data = t.detach()  # nothing below records a graph
        if data.is_complex():
            data = torch.view_as_real(data)
        as_int = _INT_OF_SIZE.get(data.element_size())
        if as_int is None:
            return None
        sums = [data.view(as_int).sum(dtype=as_int)]
        if data.is_floating_point():
            sums.append(data.sum(dtype=data.dtype).view(as_int))
        if t.device.type == "cpu":
            return tuple(int(s) for s in sums)
        return torch.stack([s.to(torch.int64) for s in sums])


def _outside_modes() -> contextlib.AbstractContextManager[Any]:
    """Leave every dispatch mode for the sums, where there is one (leaving costs ~7 us)."""
    if torch._C._len_torch_dispatch_stack() or _len_torch_dispatch_stack_pre_dispatch():
        return _disable_current_modes()
    return contextlib.nullcontext()


class Handoffs:
    """Fingerprints of what a region's units hand each other in the forward.

    ``left(t)`` when a unit returns ``t``; ``arrived(t, unit)`` when ``unit``
    receives that same tensor; ``check(region)`` before the recompute.

    Example:
        >>> handoffs = Handoffs()
        >>> handoffs.left(y); y.data.mul_(2); handoffs.arrived(y, "blocks.1")
        >>> handoffs.check("segment[blocks.0..blocks.1]")  # raises CheckpointError
    """

    def __init__(self) -> None:
        self._left: tuple[int, ...] | torch.Tensor | None = None
        self._pairs: list[
            tuple[str, tuple[int, ...] | torch.Tensor, tuple[int, ...] | torch.Tensor]
        ] = []

    def left(self, t: torch.Tensor | None) -> None:
        """A unit returned ``t`` (None: no tensor to follow)."""
        self._left = bits_checksum(t) if t is not None else None

    def arrived(self, t: torch.Tensor, unit: str) -> None:
        """``unit`` receives ``t``, the tensor last passed to :meth:`left`."""
        before, self._left = self._left, None
        if before is None:
            return
        after = bits_checksum(t)
        if after is not None and _device_of(after) == _device_of(before):
            self._pairs.append((unit, before, after))

    def check(self, region: str) -> None:
        """Raise if a handed-over tensor changed between its two units (one host sync)."""
        pairs, self._pairs = self._pairs, []
        if not pairs:
            return
        differ = [_differ(a, b) for _, a, b in pairs]
        on_device = [d for d in differ if isinstance(d, torch.Tensor)]
        if on_device and len({d.device for d in on_device}) == 1:
            synced = iter(torch.stack(on_device).tolist())  # one sync for the whole region
            changed = [next(synced) if isinstance(d, torch.Tensor) else d for d in differ]
        else:
            changed = [bool(d) for d in differ]
        if any(changed):
            unit = pairs[changed.index(True)][0]
            raise CheckpointError(
                f"gradckpt: the output of the unit before {unit} was changed between the two "
                f"units, inside {region}, in a way autograd cannot see (an in-place edit "
                "through .data, or x.data = ...): its recompute would hand the unedited "
                f"values to {unit} and the gradients would be wrong. Make the edit inside "
                f"{unit}'s forward (the recompute repeats it) or out of place "
                "(x = x * 0.5), then plan the model again (no segment will span it)."
            )
        self._pairs = pairs  # a later backward pass (retain_graph) checks them again


def _differ(
    a: tuple[int, ...] | torch.Tensor, b: tuple[int, ...] | torch.Tensor
) -> bool | torch.Tensor:
    return (a != b).any() if isinstance(a, torch.Tensor) else a != b


def _device_of(checksum: tuple[int, ...] | torch.Tensor) -> torch.device:
    return checksum.device if isinstance(checksum, torch.Tensor) else torch.device("cpu")
