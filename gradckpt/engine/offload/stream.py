"""Streamed offload: each saved tensor leaves when it is saved and returns just before use.

The grouped mode (:class:`~gradckpt.engine.offload.session.OffloadGroup`) moves
a unit's saved tensors when its forward ends and brings them all back when its
backward begins: the unit's backward holds all it saved, as it would without
offload. A :class:`StreamGroup` instead (``OffloadOptions(stream=True)``):

* **pack**: a qualifying storage (the same rule: strided, accepted by the
  backend, created by the unit's forward, at least ``min_bytes``) is copied to
  host at its first save and replaced by a handle; compute waits for that copy
  (``backend.stored``), so the storage lives only as long as the forward uses
  it. A later save of the same storage checks its version counter: written in
  place since the copy, the copy is stale, and the error says so. (A write
  after a storage's only save is not an error here, where plain autograd
  refuses the backward: the copy holds the values the forward used.);
* **close**: storages that are part of the unit's output stay on the device
  (their copy is dropped); the version of every saved tensor still alive is
  checked once more;
* **unpack**: a storage's first unpack loads it (unless it is already on its
  way) and starts loading the next storage in the group's reload order (the
  last saved first: backward's order), so one copy back overlaps the backward
  between two uses. A reload is held until each of its handles was unpacked,
  then only autograd's uses keep it.

The simulator's twin is :mod:`gradckpt.planning.kinds.offload.stream`.

Example:
    >>> session = OffloadSession(HostCopyBackend(), min_bytes=4096)
    >>> out = run_streamed(session, "layers.0", block, (x,), {}, tuple(block.parameters()))
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from gradckpt.engine.offload.session import (
    CreatedStorages,
    OffloadSession,
    _Saved,
    _tensors,
    storage_key,
    unpacked,
)

__all__ = ["StreamGroup", "run_streamed"]


class _Stored:
    """One storage of a stream group: its host copy, and its reload while on the device."""

    __slots__ = (
        "alive", "flat", "handles", "last", "nbytes", "pending", "sources", "storage", "ticket",
        "touched", "unpacked", "version",
    )  # fmt: skip

    def __init__(self, t: torch.Tensor, ticket: Any) -> None:
        self.nbytes = t.untyped_storage().nbytes()
        self.ticket = ticket  # host copy (None: it stayed on the device)
        self.version = t._version
        # Storages keep their Python object while they live: this dies with the storage.
        self.storage = weakref.ref(t.untyped_storage())
        self.sources: list[weakref.ref[torch.Tensor]] = []  # for the version check at close
        self.flat: torch.Tensor | None = None  # device bytes while loaded or kept
        self.pending: Any = None  # a load started, not yet waited for
        self.handles = 0
        self.alive = 0  # handles autograd still holds
        self.last = 0  # the group's save count at its last save
        self.touched = False  # unpacked at least once
        self.unpacked: set[int] = set()

    def source_alive(self) -> bool:
        return self.storage() is not None


class StreamGroup:
    """The saved tensors of one call of one streamed unit."""

    def __init__(self, session: OffloadSession, name: str, exclude: set[int], created: set[int]):
        self.session = session
        self.name = name
        self.exclude = exclude
        self.created = created
        self.by_key: dict[int, _Stored] = {}
        self.entries: list[_Stored] = []
        self.order: list[_Stored] | None = None  # reload order, fixed at the first unpack
        self.saves = 0
        self.closed = False
        self.offloaded_bytes = 0
        self.__weakref__: Any

    def _qualifies(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return False
        if not self.session.backend.accepts(t):
            return False
        storage = t.untyped_storage()
        key = storage.data_ptr()
        return (
            storage.nbytes() >= self.session.min_bytes
            and key in self.created
            and key not in self.exclude
        )

    def _stale(self) -> RuntimeError:
        return RuntimeError(
            f"gradckpt offload: a tensor {self.name} saved for backward was modified in "
            "place after it was saved (autograd would fail its version check); do not "
            "offload this unit"
        )

    def pack(self, t: torch.Tensor) -> Any:
        if self.closed or not self._qualifies(t):
            return t
        key = storage_key(t)
        entry = self.by_key.get(key)
        if entry is not None and not entry.source_alive():
            entry = None  # that storage is gone: a new one took its address
        if entry is None:
            backend = self.session.backend
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            entry = _Stored(t, backend.store(flat))
            backend.stored(entry.ticket)  # compute waits: the source may go when unused
            self.by_key[key] = entry
            self.entries.append(entry)
            self.offloaded_bytes += entry.nbytes
        elif t._version != entry.version:
            raise self._stale()
        self.saves += 1
        entry.last = self.saves
        entry.sources.append(weakref.ref(t))
        handle = _Saved(self, entry, t)  # the grouped mode's handle: the same bookkeeping
        entry.handles += 1
        entry.alive += 1
        return handle

    def close(self, output: Any) -> None:
        """End of the unit's forward: what is part of the output stays on the device."""
        self.closed = True
        kept = {storage_key(t): t for t in _tensors(output)}
        backend = self.session.backend
        for key, entry in self.by_key.items():
            for ref in entry.sources:
                t = ref()
                if t is not None and t._version != entry.version:
                    raise self._stale()
            source = kept.get(key)
            if source is not None and entry.source_alive():
                entry.flat = torch.empty(0, dtype=torch.uint8, device=source.device).set_(
                    source.untyped_storage()
                )
                backend.discard(entry.ticket)
                entry.ticket = None
                self.offloaded_bytes -= entry.nbytes
        for entry in self.entries:
            entry.sources = []
        self.session.events.append(("store", self.name, self.offloaded_bytes))
        weakref.finalize(self, _discard, list(self.entries), backend)

    def unpack(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        entry = handle.entry
        if not entry.touched:
            entry.touched = True
            if entry.ticket is not None:
                self._load(entry, "demand")
                self._prefetch_after(entry)
        return unpacked(self.session, self.name, handle)

    def _load(self, entry: _Stored, why: str) -> None:
        if entry.flat is None and entry.pending is None:
            entry.pending = self.session.backend.load(entry.ticket)
            self.session.events.append(("load", self.name, why))

    def _prefetch_after(self, entry: _Stored) -> None:
        if not self.session.prefetch:
            return
        if self.order is None:
            self.order = sorted(self.entries, key=lambda e: -e.last)
        after = self.order[self.order.index(entry) + 1 :]
        nxt = next((e for e in after if e.ticket is not None and not e.touched
                    and e.flat is None and e.pending is None), None)  # fmt: skip
        if nxt is not None:
            self._load(nxt, "prefetch")


def _discard(entries: list[_Stored], backend: Any) -> None:
    for entry in entries:
        if entry.ticket is not None:
            backend.discard(entry.ticket)
            entry.ticket = None


def run_streamed(
    session: OffloadSession,
    name: str,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    keep: tuple[torch.Tensor, ...] = (),
) -> Any:
    """Run ``fn(*args, **kwargs)`` with its saved tensors streamed through ``session``.

    As :func:`~gradckpt.engine.offload.session.run_offloaded`, but each storage
    leaves when it is first saved and comes back one storage ahead of its use.

    Example:
        >>> out = run_streamed(session, "layers.0", block, (x,), {}, tuple(block.parameters()))
    """
    exclude = {storage_key(t) for t in (*_tensors((args, kwargs)), *keep)}
    created = CreatedStorages()
    group = StreamGroup(session, name, exclude, created.keys)
    with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack), created:
        out = fn(*args, **kwargs)
    group.close(out)
    return out
