"""Peak memory of a region of code, by live tensor storage (CPU, CUDA, fake, meta).

Peak, as gradckpt defines it everywhere: the bytes of the model's parameters
and buffers (each storage once) plus the largest amount of live tensor storage
*created* during the region (activations, temporaries, gradients). Storage
that existed before the region (inputs, optimizer state, old gradients) is not
counted. On CUDA the allocator's own peak above the bytes allocated at entry is
recorded too, as a cross-check (``device_peak_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from gradckpt.measure.storages import StorageWatcher, storage_key

__all__ = ["MemoryTracker", "format_bytes", "state_bytes", "storage_sizes"]

MiB = 1 << 20
_BINARY_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def format_bytes(nbytes: int | None, *, round_up: bool = False, unit: str | None = None) -> str:
    """``nbytes`` in the largest binary unit that keeps the number >= 1 ("n/a" for None).

    The one byte formatter of gradckpt: messages, tables and reports all use it.
    ``round_up=True`` rounds the two decimals up, so the text read back as a
    budget (:func:`gradckpt.planning.solving.budget.parse_budget`) is never below ``nbytes``.
    ``unit`` ("KiB", "MiB", "GiB") fixes the unit, for columns that line up.

    Example:
        >>> format_bytes(3 << 20), format_bytes(1536), format_bytes(12)
        ('3.00 MiB', '1.50 KiB', '12 B')
        >>> format_bytes(4108808, round_up=True), format_bytes(1536, unit="MiB")
        ('3.92 MiB', '0.00 MiB')
    """
    if nbytes is None:
        return "n/a"
    units = _BINARY_UNITS if unit is None else [(s, n) for s, n in _BINARY_UNITS if n == unit]
    if not units:
        raise ValueError(f"unit must be one of {[n for _, n in _BINARY_UNITS]}, got {unit!r}")
    for size, name in units:
        if abs(nbytes) >= size or unit is not None:
            if round_up:
                return f"{math.ceil(nbytes * 100 / size) / 100:.2f} {name}"
            return f"{nbytes / size:.2f} {name}"
    return f"{nbytes} B"


def _model_tensors(model: nn.Module | None) -> Iterable[torch.Tensor]:
    if model is None:
        return ()
    return [*model.parameters(), *model.buffers()]


def state_bytes(model: nn.Module | None) -> int:
    """Bytes of ``model``'s parameters and buffers, each storage counted once.

    Tied weights and parameters that are views of one flat storage count once;
    a sharded parameter (DTensor) counts its local shard.

    Example:
        >>> state_bytes(nn.Linear(4, 2))  # 8 weights + 2 biases, float32
        40
    """
    return sum(storage_sizes(_model_tensors(model)).values())


def storage_sizes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes of each distinct storage behind ``tensors`` (keyed by storage; views count once).

    Example:
        >>> w = torch.zeros(4); sum(storage_sizes([w, w[:2]]).values())
        16
    """
    sizes: dict[int, int] = {}
    for t in tensors:
        # A sharded parameter (DTensor, e.g. under FSDP2) holds only its local shard.
        local = getattr(t, "_local_tensor", None)
        t = local if local is not None else t
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        sizes[storage._cdata] = storage.nbytes()
    return sizes


def _fake_mode_active() -> bool:
    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


class MemoryTracker(TorchDispatchMode):
    """Record live created tensor-storage bytes and their peak while active.

    Forward and backward ops are both seen (autograd runs backward under the
    modes active when it was called). Enter it outside gradckpt's or torch's
    checkpointing: their own dispatch modes then sit inside it. Under
    ``FakeTensorMode``, enter it *inside* the fake mode, so that it sees the
    fake outputs; the numbers equal those of the real run.

    Args:
        model: its parameters and buffers make ``param_bytes``; the storages that
            are its parameters' ``.grad`` at exit are the "grads" category.
        device: the CUDA device whose allocator peak to record; by default the
            model's, or the current one when CUDA tensors are seen.

    After exit: ``peak_bytes`` (= ``param_bytes + peak_created_bytes``),
    ``param_bytes``, ``peak_created_bytes``, ``end_bytes`` (created storages still
    alive at exit), ``breakdown`` at the peak (``{"params", "grads",
    "activations"}``), ``timeline`` and ``device_peak_bytes`` (None off CUDA).

    Example:
        >>> with MemoryTracker(model) as mt:
        ...     loss_fn().backward()
        >>> print(mt.summary())
    """

    def __init__(
        self, model: nn.Module | None = None, *, device: torch.device | str | int | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.device = device
        self._reset()

    @classmethod
    def measure(cls, model: nn.Module | None, step_fn: Callable[[], Any]) -> MemoryTracker:
        """Run ``step_fn()`` under a new tracker and return the tracker.

        Example:
            >>> mt = MemoryTracker.measure(model, lambda: loss_fn().backward())
            >>> mt.peak_bytes
        """
        with cls(model) as tracker:
            step_fn()
        return tracker

    def _reset(self) -> None:
        self.param_bytes = 0
        self.peak_created_bytes = 0
        self.end_bytes = 0
        self.breakdown: dict[str, int] = {"params": 0, "grads": 0, "activations": 0}
        self.device_peak_bytes: int | None = None
        # (allocation id, +nbytes) for an allocation, (allocation id, -nbytes) for its free
        self._events: list[tuple[int, int]] = []
        self._ids: dict[int, tuple[int, int]] = {}  # live storage key -> (allocation id, nbytes)
        self._live = 0
        self._peak_event = -1
        self._watcher: StorageWatcher | None = None
        self._cuda_index: int | None = None
        self._cuda_base = 0
        self._cuda_off = True

    # ----------------------------------------------------------------- region

    def __enter__(self) -> MemoryTracker:
        self._reset()
        self.param_bytes = state_bytes(self.model)
        self._start_cuda()
        self._watcher = StorageWatcher(self._on_alloc, self._on_free)
        return super().__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._finish()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._watcher.observe(func, out)
        return out

    def _on_alloc(self, key: int, nbytes: int) -> None:
        events = self._events
        self._ids[key] = (len(events), nbytes)  # the event index doubles as allocation id
        events.append((len(events), nbytes))
        live = self._live + nbytes
        self._live = live
        if live > self.peak_created_bytes:
            self.peak_created_bytes = live
            self._peak_event = len(events) - 1

    def _on_free(self, key: int) -> None:
        found = self._ids.pop(key, None)
        if found is None:
            return
        alloc_id, nbytes = found
        self._events.append((alloc_id, -nbytes))
        self._live -= nbytes

    def _finish(self) -> None:
        watcher, self._watcher = self._watcher, None
        self.end_bytes = self._live
        grads = self._grad_allocations()
        if watcher is not None:
            self._finish_cuda(watcher)
            watcher.close()
        self._ids = {}
        at_peak = 0
        for alloc_id in self._live_at(self._peak_event):
            if alloc_id in grads:
                at_peak += self._events[alloc_id][1]
        self.breakdown = {
            "params": self.param_bytes,
            "grads": at_peak,
            "activations": self.peak_created_bytes - at_peak,
        }

    def _grad_allocations(self) -> set[int]:
        # Which allocations are the parameters' gradients is only known at the
        # end; the event log lets us look back at the peak with that knowledge.
        found = set()
        if self.model is not None:
            for p in self.model.parameters():
                if p.grad is not None:
                    entry = self._ids.get(storage_key(p.grad))
                    if entry is not None:
                        found.add(entry[0])
        return found

    def _live_at(self, event_index: int) -> set[int]:
        live: set[int] = set()
        for alloc_id, delta in self._events[: event_index + 1]:
            if delta > 0:
                live.add(alloc_id)
            else:
                live.discard(alloc_id)
        return live

    # ------------------------------------------------------------------- CUDA

    def _start_cuda(self) -> None:
        # A CPU build never gets here past is_available(), so never reads counters.
        if not torch.cuda.is_available() or _fake_mode_active():
            return
        params = list(_model_tensors(self.model))
        if any(isinstance(t, FakeTensor) or t.is_meta for t in params):
            return
        self._cuda_off = False
        index = None
        if self.device is not None:
            device = self.device
            device = (
                torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            )
            if device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
        if index is None:
            index = next((t.get_device() for t in params if t.is_cuda), None)
        if index is None and torch.cuda.is_initialized():
            index = torch.cuda.current_device()
        if index is not None:
            torch.cuda.reset_peak_memory_stats(index)
            self._cuda_base = torch.cuda.memory_allocated(index)
            self._cuda_index = index

    def _finish_cuda(self, watcher: StorageWatcher) -> None:
        if self._cuda_off:
            return
        seen = watcher.cuda_device
        index = self._cuda_index
        if seen is None and not any(t.is_cuda for t in _model_tensors(self.model)):
            return  # a CPU run on a CUDA machine
        if index is None:
            # CUDA was initialized inside the region: its stats start there.
            index, self._cuda_base = seen, 0
        self.device_peak_bytes = torch.cuda.max_memory_allocated(index) - self._cuda_base

    # ---------------------------------------------------------------- results

    @property
    def peak_bytes(self) -> int:
        """``param_bytes + peak_created_bytes``: the peak as gradckpt defines it."""
        return self.param_bytes + self.peak_created_bytes

    @property
    def live_created_bytes(self) -> int:
        """Created storage alive now (during the region; ``end_bytes`` after it)."""
        return self._live

    @property
    def timeline(self) -> list[tuple[int, int]]:
        """``(event_index, live_created_bytes)`` after each allocation or free.

        Built from the event log on demand, so recording costs nothing extra.
        """
        out = []
        live = 0
        for i, (_, delta) in enumerate(self._events):
            live += delta
            out.append((i, live))
        return out

    @property
    def num_events(self) -> int:
        """Allocations plus frees recorded."""
        return len(self._events)

    def summary(self) -> str:
        """A small table of the peak and its parts, in MiB."""
        b = self.breakdown
        rows = [
            ("peak", self.peak_bytes),
            ("  params+buffers", b["params"]),
            ("  grads", b["grads"]),
            ("  activations", b["activations"]),
            ("created at peak", self.peak_created_bytes),
            ("alive at exit", self.end_bytes),
            ("device peak", self.device_peak_bytes),
        ]
        lines = [f"{name:<18}{format_bytes(n, unit='MiB'):>14}" for name, n in rows]
        lines.append(f"{'events':<18}{self.num_events:>14}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        b = self.breakdown
        return (
            f"MemoryTracker(peak={format_bytes(self.peak_bytes, unit='MiB')} = params "
            f"{format_bytes(b['params'], unit='MiB')} + grads {format_bytes(b['grads'], unit='MiB')}"
            f" + activations {format_bytes(b['activations'], unit='MiB')}, "
            f"end={format_bytes(self.end_bytes, unit='MiB')})"
        )
