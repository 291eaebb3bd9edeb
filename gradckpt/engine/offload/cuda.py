"""The CUDA offload backend: pinned host pool, one copy stream, events.

NOT RUN YET: this machine has no GPU. Importing it is safe anywhere (nothing
touches ``torch.cuda`` until a backend is made); the pool's bookkeeping is
tested on CPU through a fake stream/event API; the copies themselves wait for
a lent GPU (``benchmarks/gpu_check.py``).

Design (the pitfalls in ``research/landscape-2026.md`` §3.3):

* **Pinned pool**: host buffers are pinned once and reused by size class
  (``cudaHostAlloc`` costs ~3 ms a tensor); the pool never grows past
  ``host_budget`` bytes.
* **One copy stream**: a store waits for the compute stream (the source is
  written), copies device->host on the copy stream and records an event.
* **No ``record_stream``** (it fragments the allocator and grows memory without
  bound): before the session drops a source, :meth:`stored` makes the
  *compute* stream wait for the copy's event, so any later kernel that reuses
  the source's block runs after the copy. The wait is on the GPU; the host
  runs on. Since the session drops sources at the end of each unit's forward,
  the forward stash is bounded to one unit.
* **Reload buffers are allocated on the compute stream** (so the caching
  allocator's ownership is right), filled on the copy stream after it waits for
  the compute stream, and :meth:`loaded` makes the compute stream wait for the
  fill's event before the first read. Loads are started one offloaded unit
  ahead of the backward that needs them (the session's prefetch).
* A pinned buffer goes back to the pool only once its last copy's event has
  completed, so a buffer is never overwritten while a copy still reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradckpt.engine.offload.store import HostOverBudgetError

__all__ = ["CudaOffloadBackend", "PinnedPool", "size_class"]

_MIN_CLASS = 1 << 12


def size_class(nbytes: int) -> int:
    """The pool's buffer size for ``nbytes``: the next power of two (at least 4 KiB).

    Example:
        >>> size_class(5000)
        8192
    """
    return max(_MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())


@dataclass
class _Pinned:
    buffer: torch.Tensor  # uint8, pinned, of a size class
    nbytes: int  # bytes in use
    event: Any = None  # the last copy that touches it (None: none pending)


class PinnedPool:
    """Pinned host buffers by size class, reused once their last copy completed.

    ``allocate(n)`` makes a buffer (``torch.empty(n, pin_memory=True)`` by default);
    tests pass a plain allocator. ``host_budget`` caps the bytes of all buffers
    made, free or in use.

    Example:
        >>> pool = PinnedPool(host_budget=8 << 30)
        >>> block = pool.take(10_000); pool.give(block)
    """

    def __init__(self, host_budget: int | None = None, allocate: Any = None) -> None:
        self.host_budget = host_budget
        self.allocate = allocate or (
            lambda n: torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=True)
        )
        self.free: dict[int, list[_Pinned]] = {}
        self.made_bytes = 0  # bytes of every buffer made (pinned pages are not swappable)
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.made = 0

    def take(self, nbytes: int) -> _Pinned:
        size = size_class(nbytes)
        ready = [b for b in self.free.get(size, ()) if b.event is None or b.event.query()]
        if ready:
            block = ready[0]
            self.free[size].remove(block)
        else:
            if self.host_budget is not None and self.made_bytes + size > self.host_budget:
                raise HostOverBudgetError(
                    f"gradckpt offload: a pinned buffer of {size} bytes would bring the pool "
                    f"to {self.made_bytes + size} bytes, over the host budget of "
                    f"{self.host_budget}; plan with a larger host budget or offload less"
                )
            block = _Pinned(self.allocate(size), 0)
            self.made_bytes += size
            self.made += 1
        block.nbytes = nbytes
        self.in_use_bytes += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return block

    def give(self, block: _Pinned) -> None:
        """Return ``block``; it is handed out again once its last copy has completed."""
        size = block.buffer.numel()
        self.in_use_bytes -= size
        self.free.setdefault(size, []).append(block)


class CudaOffloadBackend:
    """Offload through pinned host memory on one copy stream (see the module docstring).

    Args:
        device: the CUDA device whose tensors are offloaded.
        host_budget: most pinned bytes the pool may make.
        streams: a stand-in for ``torch.cuda`` (``Stream``, ``Event``,
            ``current_stream``, ``stream``) for tests without a GPU.

    Example:
        >>> session = OffloadSession(CudaOffloadBackend("cuda"), min_bytes=4096)
    """

    def __init__(
        self, device: str | torch.device = "cuda", *, host_budget: int | None = None,
        streams: Any = None, allocate: Any = None,
    ) -> None:  # fmt: skip
        self.device = torch.device(device)
        if streams is None:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "gradckpt offload: the CUDA backend needs a CUDA device; on a CPU-only "
                    "machine use HostCopyBackend (offload_backend='host')"
                )
            streams = torch.cuda
        self.streams = streams
        self.copy_stream = streams.Stream(device=self.device)
        self.pool = PinnedPool(host_budget, allocate)

    @property
    def host_bytes(self) -> int:
        return self.pool.in_use_bytes

    @property
    def peak_host_bytes(self) -> int:
        return self.pool.peak_in_use_bytes

    def accepts(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type

    def store(self, flat: torch.Tensor) -> _Pinned:
        block = self.pool.take(flat.numel())
        compute = self.streams.current_stream(self.device)
        self.copy_stream.wait_stream(compute)  # the source's writes come first
        with self.streams.stream(self.copy_stream):
            block.buffer[: flat.numel()].copy_(flat, non_blocking=True)
            block.event = self.streams.Event()
            block.event.record(self.copy_stream)
        return block

    def stored(self, ticket: _Pinned) -> None:
        # The compute stream, not the host, waits: after this the source's block may
        # be reused by later kernels, which now run after the copy (no record_stream).
        self.streams.current_stream(self.device).wait_event(ticket.event)

    def load(self, ticket: _Pinned) -> tuple[_Pinned, torch.Tensor, Any]:
        compute = self.streams.current_stream(self.device)
        reload = torch.empty(ticket.nbytes, dtype=torch.uint8, device=self.device)  # on compute
        self.copy_stream.wait_stream(compute)
        with self.streams.stream(self.copy_stream):
            reload.copy_(ticket.buffer[: ticket.nbytes], non_blocking=True)
            done = self.streams.Event()
            done.record(self.copy_stream)
        ticket.event = done  # the pinned buffer is busy until this copy completes
        return ticket, reload, done

    def loaded(self, pending: tuple[_Pinned, torch.Tensor, Any]) -> torch.Tensor:
        _, reload, done = pending
        self.streams.current_stream(self.device).wait_event(done)
        return reload

    def discard(self, ticket: _Pinned) -> None:
        self.pool.give(ticket)
