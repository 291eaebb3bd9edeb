"""What the device allocator itself holds: peak bytes of a region, and per marked span.

The :class:`~gradckpt.measure.MemoryTracker` counts the tensor storages that
ATen ops return. Memory a kernel allocates *inside itself* (convolution
backward's columns, oneDNN/cuDNN/cuBLAS workspaces, code compiled by inductor)
never reaches the dispatcher, but the allocator serves it and an OOM counts it.
:class:`AllocatorTracker` measures at that level:

* **CPU**: torch's CPU allocator reports every allocation and free to the
  profiler when memory profiling is on, with its running total of bytes
  allocated *while profiling* (memory that existed before the region, and its
  free, is not counted: the same "created during the region" rule as the
  tracker). We switch on a profiler that observes only user-scope record
  functions (no per-op events), so the overhead is the memory events alone;
  the peak is the largest total of the blocks allocated in the region and
  not yet freed.
  ``tests/measure/test_allocator.py`` checks it against a malloc-level counter
  preloaded into a child interpreter (within 1%).
* **CUDA**: the caching allocator's own statistics, ``max_memory_allocated``
  after ``reset_peak_memory_stats`` (above what was allocated at entry), and
  ``max_memory_reserved`` for what the allocator took from the driver
  (segments, fragmentation). Those counters read zero on a CPU-only build and
  are never used for CPU.

:func:`marked_spans` reads the same profiler events per span opened with
:func:`open_mark`/:func:`close_mark`: the profiler (``gradckpt.profile``) marks
every ATen op with it and gets each op's transient workspace.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch._C import _autograd as _ag
from torch._C import _profiler as _prof

from gradckpt.measure.exclusive import MEASURING

__all__ = [
    "CUDA_BLOCK_BYTES",
    "AllocatorTracker",
    "MarkedSpan",
    "MemoryEvents",
    "allocator_block_bytes",
    "close_mark",
    "foreign_profiler_running",
    "marked_spans",
    "open_mark",
]

_MARK = "gradckpt#"

#: Marks of :meth:`AllocatorTracker.note_level` (above any op index a profile marks).
_LEVEL_MARKS = 1 << 50

#: The CUDA caching allocator hands out blocks in multiples of this many bytes.
CUDA_BLOCK_BYTES = 512


def allocator_block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts for a request of ``nbytes``.

    It rounds every request up to a multiple of 512 bytes (0 stays 0). Not
    modelled: ``roundup_power2_divisions`` (rounds large blocks further),
    segment sizes (2 MiB / 20 MiB: they shape *reserved* memory), fragmentation
    and ``expandable_segments`` (both affect reserved, not allocated, bytes).

    Example:
        >>> allocator_block_bytes(1), allocator_block_bytes(513)
        (512, 1024)
    """
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


# What torch's profiler writes to the process's stderr on every start and stop
# (kineto's trace points) and when a block allocated before profiling is freed.
_NOISE = re.compile(
    rb"^(USDT:.*SyncActivityProfilerHandler|\[W.*CPUAllocator.*Memory block of unknown size)"
)


class _FilteredStderr:
    """Hold the process's stderr (fd 2) in a file while active; pass on all but profiler noise.

    Output written meanwhile (by the user's code too) is not lost, only delayed
    until the region ends.
    """

    def __enter__(self) -> _FilteredStderr:
        self.saved = None
        try:
            sys.stderr.flush()
            self.held = tempfile.TemporaryFile()
            self.saved = os.dup(2)
            os.dup2(self.held.fileno(), 2)
        except (OSError, ValueError, AttributeError):  # no real fd 2 (embedded, notebooks)
            self.saved = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is None:
            return
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.held.seek(0)
        kept = [line for line in self.held.read().splitlines(True) if not _NOISE.match(line)]
        self.held.close()
        if kept:
            os.write(2, b"".join(kept))


def _start_memory_events(device: torch.device) -> None:
    if _ag._profiler_enabled():
        raise RuntimeError(
            "allocator-level measurement needs torch's profiler and another profiler is "
            "already running; measure outside torch.profiler.profile(...)"
        )
    # Allocators report to the profiler from the host side: the CPU activity is
    # enough for CUDA memory events too, and needs no CUPTI.
    activities = {_prof.ProfilerActivity.CPU}
    config = _prof.ProfilerConfig(
        _prof.ProfilerState.KINETO, False, True, False, False, False, _prof._ExperimentalConfig()
    )
    _ag._prepare_profiler(config, activities)
    # Only user-scope record functions (our marks) are observed, not every op:
    # memory events are reported regardless, so this keeps the overhead small.
    _ag._enable_profiler(config, activities, {_prof.RecordScope.USER_SCOPE})


def _walk(events: list[Any], mark: int, out: list[tuple]) -> None:
    """Flatten the event tree to (start_ns, mark, alloc_size, ptr, device)."""
    for e in events:
        if e.tag == _prof._EventType.Allocation:
            f = e.extra_fields
            out.append((e.start_time_ns, mark, f.alloc_size, f.ptr, f.device))
        else:
            name = e.name
            inner = int(name[len(_MARK) :]) if name.startswith(_MARK) else mark
            _walk(e.children, inner, out)


def _flat_events(result: Any) -> list[tuple]:
    """The events of one profiler session as (start_ns, mark, alloc_size, block, device)."""
    flat: list = []
    _walk(result.experimental_event_tree(), -1, flat)
    return flat


def _allocation_events(flat: list[tuple], device: torch.device) -> list[tuple[int, ...]]:
    """(start_ns, mark or -1, bytes allocated (+) or freed (-), live total, block) on ``device``.

    The total counts only blocks allocated inside the region: the free of a
    block that existed before it is dropped (the allocator's own running total
    would count it, and it can even be stale: a block allocated under an
    earlier profiler session and freed between sessions stays in its table).
    """
    flat = sorted(flat, key=lambda e: e[0])  # the tree is ordered per thread; merge by time
    index = device.index if device.index is not None else 0
    live: dict[int, int] = {}
    total = 0
    keep = []
    for start, mark, size, ptr, where in flat:
        if where.type != device.type or (device.type == "cuda" and where.index != index):
            continue
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
        elif ptr in live:
            size = -live.pop(ptr)
        else:
            continue  # made before the region
        total += size
        keep.append((start, mark, size, total, ptr))
    return keep


def _unmarked(flat: list[tuple]) -> list[tuple]:
    """Flat events as an enclosing session sees them: outside every mark of its own."""
    return [(t, -1, size, ptr, where) for t, _, size, ptr, where in flat]


@dataclass(frozen=True)
class MarkedSpan:
    """Allocator bytes around one marked span (totals of blocks allocated in the region)."""

    before: int  # allocated when the span opened (at its first event)
    peak: int  # the most allocated at any moment inside it
    after: int  # allocated at its last event
    #: Bytes allocated outside every span since the previous one and still held when
    #: this one opened: e.g. the scalar tensors Python numbers become for this op's call.
    loose: int = 0


def open_mark(index: int) -> Any:
    """Open span ``index`` for :func:`marked_spans` (a user-scope record function).

    Example:
        >>> handle = open_mark(7); y = x * 2; close_mark(handle)
    """
    return torch.ops.profiler._record_function_enter_new(f"{_MARK}{index}", None)


def close_mark(handle: Any) -> None:
    """Close a span opened by :func:`open_mark`."""
    torch.ops.profiler._record_function_exit._RecordFunction(handle)


def marked_spans(events: list[tuple[int, ...]]) -> dict[int, MarkedSpan]:
    """Per mark index, the allocator's bytes before, at the peak inside, and after it.

    Example:
        >>> with MemoryEvents() as ev:
        ...     h = open_mark(0); y = torch.empty(10); close_mark(h)
        >>> ev.spans()[0].peak - ev.spans()[0].before
        40
    """
    spans: dict[int, list[int]] = {}
    loose: dict[int, int] = {}  # block -> bytes, allocated outside every span, still held
    for _, mark, size, total, block in events:
        if mark < 0:
            if size > 0:
                loose[block] = size
            else:
                loose.pop(block, None)
            continue
        span = spans.get(mark)
        if span is None:
            spans[mark] = [total - size, max(total, total - size), total, sum(loose.values())]
            loose.clear()  # charged to this span
        else:
            span[1] = max(span[1], total)
            span[2] = total
    return {m: MarkedSpan(*s) for m, s in spans.items()}


#: Our open sessions, outermost first. Torch runs one profiler at a time, so only
#: the innermost one runs; the ones around it are paused and get its events.
_OPEN: list[MemoryEvents] = []
_STDERR: list[_FilteredStderr] = []  # the filter of the open sessions, while any is open


def foreign_profiler_running() -> bool:
    """True when a profiler that is not one of ours runs (ours nest; a foreign one does not)."""
    return bool(_ag._profiler_enabled()) and not _OPEN


class MemoryEvents:
    """The allocator's allocation and free events during a region, from torch's profiler.

    Works on CPU and CUDA (the caching allocator reports its blocks too). After
    the ``with`` block: ``events`` as ``(start_ns, mark, delta, running_total, block)``
    (``mark`` is the innermost :func:`open_mark` span, -1 outside every one),
    ``peak_bytes`` and ``end_bytes`` of the blocks allocated inside the region.

    Sessions nest: one opened inside another (``gradckpt.profile`` inside an
    :class:`AllocatorTracker` around a whole ``fit``) pauses the outer one, and
    the outer one gets the inner one's events when it ends (their marks as -1).
    What is allocated in the instants between the two sessions is not seen.

    Example:
        >>> with MemoryEvents() as ev:
        ...     loss_fn().backward()
        >>> ev.peak_bytes
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.events: list[tuple[int, ...]] = []
        self.peak_bytes = 0
        self.end_bytes = 0
        self._flat: list[tuple] = []

    def __enter__(self) -> MemoryEvents:
        MEASURING.acquire()  # one profiler per process: another thread's session waits
        outer = _OPEN[-1] if _OPEN else None
        if outer is None:  # one filter for the sessions open together, whatever order they close in
            _STDERR.append(_FilteredStderr().__enter__())
        try:
            if outer is not None:
                outer._pause()
            _start_memory_events(self.device)
        except BaseException:
            if outer is not None:
                _start_memory_events(outer.device)
            else:
                _STDERR.pop().__exit__()
            MEASURING.release()
            raise
        _OPEN.append(self)
        return self

    def _pause(self) -> None:
        self._flat.extend(_flat_events(_ag._disable_profiler()))

    def __exit__(self, *exc: object) -> None:
        at = _OPEN.index(self)
        later = _OPEN[at + 1 :]  # still open: this one closes out of order
        seen: list[tuple] = []
        try:
            # The running profiler records for the innermost open session.
            (later[-1] if later else self)._pause()
        finally:
            try:
                _OPEN.remove(self)
                if at > 0:  # hand our own events to the session around us
                    _OPEN[at - 1]._flat.extend(_unmarked(self._flat))
                # What the sessions opened inside this one saw so far happened while
                # it was open too; they keep it and hand it on when they close.
                seen = self._flat + [e for inner in later for e in _unmarked(inner._flat)]
                if _OPEN:  # let the innermost open session run again
                    _start_memory_events(_OPEN[-1].device)
                else:
                    _STDERR.pop().__exit__()
            finally:
                MEASURING.release()
        self.events = _allocation_events(seen, self.device)
        self._flat = []
        if not self.events:
            return
        self.peak_bytes = max(0, max(e[3] for e in self.events))
        self.end_bytes = self.events[-1][3]

    def spans(self) -> dict[int, MarkedSpan]:
        """Per mark index, the allocator's bytes around that span."""
        return marked_spans(self.events)


class AllocatorTracker:
    """Peak bytes the device's allocator held above its level at entry, during a region.

    Args:
        device: "cpu" (default) or a CUDA device; where the step's memory lives.

    After the ``with`` block: ``peak_bytes`` (the most allocated above entry),
    ``end_bytes`` (allocated at exit minus at entry), ``reserved_peak_bytes``
    (CUDA: the most reserved above what was reserved at entry; None on CPU),
    ``method`` (how it was measured). On CPU the region runs under torch's
    profiler with memory events only (measured overhead in
    ``tests/measure/test_allocator.py``: the same order as the allocations
    themselves, small next to real kernels); it cannot run inside another
    profiler.

    Example:
        >>> with AllocatorTracker() as at:
        ...     loss_fn().backward()
        >>> at.peak_bytes  # includes kernel workspaces the MemoryTracker cannot see
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"allocator-level measurement supports cpu and cuda, not {self.device.type!r}; "
                "use gradckpt.measure.MemoryTracker for tensor-level bytes"
            )
        self.method = "cuda-allocator-stats" if self.device.type == "cuda" else "profiler-events"
        self.peak_bytes = 0
        self.end_bytes = 0
        self.reserved_peak_bytes: int | None = None
        #: CUDA: the most the caching allocator had reserved from the device during the
        #: region, in all (not above entry): what an out-of-memory error sees. None on CPU.
        self.reserved_high_water_bytes: int | None = None
        #: The allocator's level above entry at each :meth:`note_level`, read at exit
        #: (None: the moment left no event to read it from).
        self.levels: list[int | None] = []
        self._events: MemoryEvents | None = None
        self._entry = (0, 0)
        self._noted = 0

    def __enter__(self) -> AllocatorTracker:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._entry = (
                torch.cuda.memory_allocated(self.device),
                torch.cuda.memory_reserved(self.device),
            )
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._events = MemoryEvents(self.device).__enter__()
        return self

    def note_level(self) -> None:
        """Note the allocator's level now (above entry); ``levels`` has it after exit.

        On CPU a span with one 1-element tensor marks the moment (the events hold the
        running total); on CUDA the allocator's counter is read at once.

        Example:
            >>> with AllocatorTracker() as at:
            ...     loss = loss_fn(); at.note_level(); loss.backward()
            >>> at.levels[0]  # what the forward left allocated
        """
        if self._events is None:
            self.levels.append(torch.cuda.memory_allocated(self.device) - self._entry[0])
            return
        handle = open_mark(_LEVEL_MARKS + self._noted)
        torch.empty(1, device=self.device)
        close_mark(handle)
        self._noted += 1

    def __exit__(self, *exc: object) -> None:
        if self._events is None:
            torch.cuda.synchronize(self.device)
            allocated, reserved = self._entry
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - allocated
            self.end_bytes = torch.cuda.memory_allocated(self.device) - allocated
            self.reserved_high_water_bytes = torch.cuda.max_memory_reserved(self.device)
            self.reserved_peak_bytes = self.reserved_high_water_bytes - reserved
            return
        self._events.__exit__(*exc)
        self.peak_bytes = self._events.peak_bytes
        self.end_bytes = self._events.end_bytes
        spans = self._events.spans() if self._noted else {}
        levels = (spans.get(_LEVEL_MARKS + i) for i in range(self._noted))
        self.levels = [span.before if span is not None else None for span in levels]

    def __repr__(self) -> str:
        return f"AllocatorTracker({self.device}, peak={self.peak_bytes} B, end={self.end_bytes} B)"
