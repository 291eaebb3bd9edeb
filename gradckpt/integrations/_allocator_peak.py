"""Allocator-level peak of a region, for compiled steps (inductor allocates outside the dispatcher).

Uses ``gradckpt.measure.AllocatorTracker`` when the package has it; until
then, a minimal equivalent on CPU: torch's profiler with memory events only,
the peak being the largest total of blocks allocated inside the region and
not yet freed (blocks from before the region, and their frees, are ignored).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["AllocatorPeak"]

try:  # the measure layer's tracker (issue 8), preferred when present
    from gradckpt.measure import AllocatorTracker as _Tracker
except ImportError:  # pragma: no cover - depends on the branch
    _Tracker = None


class AllocatorPeak:
    """``with AllocatorPeak() as m: step()`` then ``m.peak_bytes`` (allocator bytes above entry).

    Example:
        >>> with AllocatorPeak() as m:
        ...     loss_fn().backward()
        >>> m.peak_bytes
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.method = "gradckpt.measure.AllocatorTracker" if _Tracker else "profiler-events"
        self._inner: Any = None

    def __enter__(self) -> AllocatorPeak:
        if _Tracker is not None:
            self._inner = _Tracker("cpu").__enter__()
        else:
            self._inner = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            ).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)
        if _Tracker is not None:
            self.peak_bytes = int(self._inner.peak_bytes)
            return
        events: list[tuple[int, int, int]] = []
        _walk(self._inner.profiler.kineto_results.experimental_event_tree(), events)
        events.sort()
        live: dict[int, int] = {}
        total = peak = 0
        for _, size, ptr in events:
            if size > 0:
                live[ptr] = live.get(ptr, 0) + size
            elif ptr in live:
                size = -live.pop(ptr)
            else:
                continue  # freed here, allocated before the region
            total += size
            peak = max(peak, total)
        self.peak_bytes = peak


def _walk(nodes: list[Any], out: list[tuple[int, int, int]]) -> None:
    from torch._C._profiler import _EventType

    for node in nodes:
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                out.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        _walk(node.children, out)
