"""Where offloaded bytes go: the backend interface and the host-copy backend.

A backend moves whole storages (as flat ``uint8`` tensors) out of the compute
pool and back. The session (:mod:`gradckpt.engine.offload.session`) decides *what*
moves and *when*; a backend only knows *how*:

* ``store(flat)`` starts copying ``flat`` out and returns a ticket;
* ``stored(ticket)`` is called before the source is dropped: after it, the
  source's memory may be reused (on CUDA: the compute stream waits for the copy);
* ``load(ticket)`` allocates a device buffer and starts filling it;
* ``loaded(ticket)`` is called before the buffer is read;
* ``discard(ticket)`` frees the host bytes.

:class:`HostCopyBackend` runs anywhere torch runs on CPU: the "host store" is
memory outside torch's allocator (Python ``bytearray``), so trackers of the
compute pool (``gradckpt.measure.MemoryTracker``, the allocator tracker) see the
source freed and the reload allocated, never the stored copy. That lets a
CPU-only machine check gradients bit for bit, the compute pool's peak and the
host bytes exactly. It copies synchronously: it says nothing about overlap,
which is the CUDA backend's job (:mod:`gradckpt.engine.offload.cuda`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["HostCopyBackend", "HostOverBudgetError", "OffloadBackend"]


class HostOverBudgetError(RuntimeError):
    """Storing one more tensor would pass the host-memory budget."""


class OffloadBackend(Protocol):
    """How saved bytes leave the compute pool and come back (see the module docstring)."""

    host_bytes: int
    peak_host_bytes: int

    def accepts(self, t: torch.Tensor) -> bool: ...
    def store(self, flat: torch.Tensor) -> Any: ...
    def stored(self, ticket: Any) -> None: ...
    def load(self, ticket: Any) -> Any: ...
    def loaded(self, ticket: Any) -> torch.Tensor: ...
    def discard(self, ticket: Any) -> None: ...


@dataclass
class _HostBlock:
    data: bytearray
    device: torch.device
    reload: torch.Tensor | None = field(default=None, repr=False)


class HostCopyBackend:
    """Copies saved storages into host memory outside torch's allocator (CPU tensors).

    Args:
        host_budget: most host bytes held at once (None: no limit); passing it
            raises :class:`HostOverBudgetError` rather than silently keeping more.

    Example:
        >>> backend = HostCopyBackend(host_budget=1 << 30)
        >>> with OffloadSession(backend).unit("layers.0"): ...
        >>> backend.peak_host_bytes
    """

    def __init__(self, host_budget: int | None = None) -> None:
        self.host_budget = host_budget
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.stores = 0
        self.loads = 0

    def accepts(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def store(self, flat: torch.Tensor) -> _HostBlock:
        n = flat.numel()
        if self.host_budget is not None and self.host_bytes + n > self.host_budget:
            raise HostOverBudgetError(
                f"gradckpt offload: storing {n} more bytes would hold {self.host_bytes + n} "
                f"host bytes, over the host budget of {self.host_budget}; plan with a larger "
                "host budget or offload fewer units"
            )
        data = bytearray(n)
        if n:
            ctypes.memmove((ctypes.c_char * n).from_buffer(data), flat.data_ptr(), n)
        self.host_bytes += n
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.stores += 1
        return _HostBlock(data, flat.device)

    def stored(self, ticket: _HostBlock) -> None:
        """The copy above is synchronous: nothing to wait for."""

    def load(self, ticket: _HostBlock) -> _HostBlock:
        n = len(ticket.data)
        # Allocated with the current dispatch modes active, so that trackers of
        # the compute pool see the reload buffer as the live bytes it is.
        buffer = torch.empty(n, dtype=torch.uint8, device=ticket.device)
        if n:
            with _disable_current_modes():
                ctypes.memmove(buffer.data_ptr(), (ctypes.c_char * n).from_buffer(ticket.data), n)
        ticket.reload = buffer
        self.loads += 1
        return ticket

    def loaded(self, ticket: _HostBlock) -> torch.Tensor:
        buffer, ticket.reload = ticket.reload, None
        assert buffer is not None, "internal: loaded() without load()"
        return buffer

    def discard(self, ticket: _HostBlock) -> None:
        self.host_bytes -= len(ticket.data)
        ticket.data = bytearray()
