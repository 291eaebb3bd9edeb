"""What a CPU step takes from malloc beside the allocator's blocks: autograd's graph, Python.

torch's allocator reports tensor storage (and kernel workspace) to the profiler;
autograd's nodes, the engine's and the step's Python objects come from malloc
too, and a budget counted at malloc's level holds them. On a CPU step they are
small (a 106-op ResNet step: 84 KiB beside 32.1 MiB; a 620-op GPT: 218 KiB
beside 19.7 MiB) but not nothing next to a plan that fills its budget.

glibc's ``mallinfo2`` (2.33+) gives the bytes in use now, all arenas and
mmapped blocks together (within 0.1% of a preloaded malloc counter). Read at
the end of a measured step's forward, when autograd's graph is whole, beside
the allocator's level at the same moment
(:meth:`~gradckpt.measure.AllocatorTracker.note_level`), the difference above
the step's start is what the step held beside its tensors.

Example:
    >>> before = malloc_in_use()
    >>> loss = loss_fn()
    >>> malloc_in_use() - before  # tensors and everything beside them
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gradckpt.measure.allocator import AllocatorTracker

__all__ = ["BesideReading", "MallInfo2", "mall_info", "malloc_in_use", "tracker_bytes"]


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def mall_info(libc: ctypes.CDLL) -> MallInfo2 | None:
    """``mallinfo2()`` (None without it: glibc before 2.33, or another C library)."""
    try:
        fn = libc.mallinfo2  # the older mallinfo's int fields overflow
    except AttributeError:
        return None
    fn.restype = MallInfo2
    return fn()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def malloc_in_use() -> int | None:
    """Bytes malloc has handed out and not taken back, now (None where glibc cannot say).

    Example:
        >>> malloc_in_use() > 0
        True
    """
    libc = _libc()
    info = mall_info(libc) if libc is not None else None
    return None if info is None else info.uordblks + info.hblkhd


class BesideReading:
    """What a step measured under ``tracker`` held beside the allocator's blocks.

    Make it inside the tracker's region before the step, call :meth:`forward_done`
    once the forward has returned, read :meth:`bytes` after the region: 0 off the
    CPU, without glibc, or when the forward end was not noted.

    Example:
        >>> with AllocatorTracker() as at:
        ...     beside = BesideReading(at)
        ...     loss = loss_fn(); beside.forward_done(); loss.backward()
        >>> beside.bytes()
    """

    def __init__(self, tracker: AllocatorTracker) -> None:
        self.tracker = tracker
        self.before = malloc_in_use() if tracker.device.type == "cpu" else None
        self.at_forward_end: int | None = None

    def forward_done(self) -> None:
        """Note malloc's bytes and the allocator's level: autograd's graph is whole now."""
        if self.before is None or self.at_forward_end is not None:
            return
        self.at_forward_end = malloc_in_use()
        self.tracker.note_level()

    def bytes(self) -> int:
        """Bytes beside the allocator's at the forward's end, above the step's start."""
        if self.before is None or self.at_forward_end is None or not self.tracker.levels:
            return 0
        return max(0, self.at_forward_end - self.before - self.tracker.levels[0])


def tracker_bytes(events: int) -> int:
    """What an :class:`~gradckpt.measure.AllocatorTracker` itself takes from malloc while it
    records ``events`` allocations and frees: torch's profiler keeps each event (measured
    once per process: 24 KiB to start and ~150 bytes an event on torch 2.13), so a step
    measured under it holds that much more than the same step unmeasured. 0 without glibc.

    Example:
        >>> tracker_bytes(1000) > tracker_bytes(10)
        True
    """
    base, per_event = _tracker_cost()
    return base + int(per_event * events) if base or per_event else 0


@functools.cache
def _tracker_cost() -> tuple[int, float]:
    """(bytes at the first event, bytes per further event) of a tracker session, measured."""
    from gradckpt.measure.allocator import AllocatorTracker

    x = torch.zeros(64)
    grown = []
    for n in (4, 404):  # allocations (each an allocation event and a free event)
        with AllocatorTracker():
            before = malloc_in_use()
            for _ in range(n):
                y = x + 1
                del y
            after = malloc_in_use()
        if before is None or after is None:
            return 0, 0.0
        grown.append(after - before)
    per_event = max(0.0, (grown[1] - grown[0]) / (2 * 400))
    return max(0, grown[0]), per_event
