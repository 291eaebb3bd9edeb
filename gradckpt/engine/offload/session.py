"""Offload a unit's saved tensors to host memory and bring them back in backward.

The third decision besides keeping and recomputing: a unit runs plainly, but
what autograd saves inside it leaves the compute pool at the end of the unit's
forward and comes back when backward gets near it. On
``torch.autograd.graph.saved_tensors_hooks``, one :class:`OffloadGroup` per
unit call:

* **pack** (forward): a saved tensor that qualifies (a strided tensor the
  backend accepts whose storage an op of the unit's forward created, at least
  ``min_bytes``) is recorded by storage (views of one storage share one copy)
  and replaced by a small handle. What the unit did not create (its inputs,
  parameters, buffers, a mask cached as a module attribute, a module-level
  tensor) is saved by reference: something outside the unit holds it, so a
  copy out frees nothing and the copy back would be a second device copy the
  planner never counted (it moves only storages whose producer is inside the
  unit, :func:`gradckpt.planning.kinds.offload.sim.moved_storages`). Which storages
  the forward created is seen by :class:`CreatedStorages`, a dispatch mode
  over the unit's forward;
* **close** (end of the unit's forward): storages that are part of the unit's
  output stay (the next unit holds them anyway); the others are copied out by
  the backend, version counters are checked as autograd would, and the
  group's references to the sources are dropped, so the compute pool frees
  them as soon as the forward no longer needs them;
* **unpack** (backward): the first unpack of a group loads it (if it was not
  prefetched) and *prefetches the previous offloaded group*, so its copy
  overlaps the backward of the units in between; a reloaded storage is held
  until every handle of it has been unpacked once, then only autograd's uses
  keep it.

The order of these events is recorded in :attr:`OffloadSession.events`
(``("store"|"drop"|"load"|"unpack", unit, detail)``; "unpack" is a group's first)
for tests. The forward stash is one group deep: a group's sources are dropped
when the next offloaded unit's forward ends (its copy overlaps that compute);
the last group's are still held when backward reaches it, and are used as they
are (no copy back).

Example:
    >>> session = OffloadSession(HostCopyBackend(), min_bytes=4096)
    >>> out = run_offloaded(session, "layers.0", block, (x,), {})
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradckpt.engine.offload.store import HostCopyBackend, OffloadBackend

__all__ = ["CreatedStorages", "OffloadGroup", "OffloadSession", "run_offloaded", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage while it is alive (views of one storage share it)."""
    return t.untyped_storage().data_ptr()


class CreatedStorages(TorchDispatchMode):
    """Records the storages that ops create while it is active (a unit's forward).

    An op's output storage counts as created unless one of the op's own inputs
    has it (views, in-place and ``out=`` ops write into existing storages).
    Costs one Python call per op of an offloaded unit, against copies of its
    saved bytes; it is the run-time twin of the profile's producers.
    """

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs: set[int] | None = None
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if type(t) is not torch.Tensor or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.keys or not storage.nbytes():
                continue
            if inputs is None:
                inputs = _input_keys(args, kwargs)
            if key not in inputs:
                self.keys.add(key)
        return out


def _input_keys(args: Any, kwargs: Any) -> set[int]:
    flat, _ = tree_flatten((args, kwargs))
    keys = set()
    for x in flat:
        if isinstance(x, torch.Tensor) and x.layout == torch.strided:
            keys.add(x.untyped_storage().data_ptr())
        elif isinstance(x, torch.UntypedStorage):  # set_(storage): not a new one
            keys.add(x.data_ptr())
    return keys


class _Entry:
    """One storage saved by a group: the sources until close, then a host ticket."""

    __slots__ = (
        "alive", "flat", "handles", "key", "nbytes", "pending", "sources", "ticket", "unpacked",
    )  # fmt: skip
    # ``flat`` is the storage as uint8 while it is on the device: the source until the
    # group drops it, a reload buffer after a load, until every handle was unpacked.

    def __init__(self, key: int, t: torch.Tensor) -> None:
        self.key = key
        self.nbytes = t.untyped_storage().nbytes()
        self.sources: list[tuple[torch.Tensor, int]] = []  # (tensor, version at pack)
        self.flat: torch.Tensor | None = None  # device bytes while on device
        self.ticket: Any = None  # host copy (None: never left the device)
        self.pending: Any = None  # a load started, not yet waited for
        self.handles = 0
        self.alive = 0  # handles autograd still holds
        self.unpacked: set[int] = set()


class _Saved:
    """What autograd holds instead of an offloaded tensor."""

    __slots__ = ("__weakref__", "dtype", "entry", "group", "index", "offset", "size", "stride")

    def __init__(self, group: OffloadGroup, entry: _Entry, t: torch.Tensor) -> None:
        self.group, self.entry, self.index = group, entry, entry.handles
        self.dtype, self.size, self.stride = t.dtype, t.size(), t.stride()
        self.offset = t.storage_offset()

    def __del__(self) -> None:
        # Autograd released this saved tensor: once all of a storage's are released,
        # nothing can unpack it again, so a storage still on the device goes now, as
        # it would under plain autograd.
        entry = self.entry
        entry.alive -= 1
        if entry.alive == 0:
            entry.flat = None


def unpacked(session: OffloadSession, name: str, handle: _Saved) -> torch.Tensor:
    """The tensor ``handle`` stands for, from its storage's device bytes (waiting for a load
    started earlier, or loading now when none was: a second backward, ``retain_graph``).

    Shared by the grouped and the streamed groups; runs once per unpack.
    """
    entry = handle.entry
    if entry.flat is None:
        if entry.pending is None:
            entry.pending = session.backend.load(entry.ticket)
            session.events.append(("load", name, "again"))
        entry.flat = session.backend.loaded(entry.pending)
        entry.pending = None
    out = torch.empty(0, dtype=handle.dtype, device=entry.flat.device).set_(
        entry.flat.untyped_storage(), handle.offset, handle.size, handle.stride
    )
    entry.unpacked.add(handle.index)
    if entry.ticket is not None and len(entry.unpacked) == entry.handles:
        entry.flat = None  # from here on, only autograd's uses hold the reload
        entry.unpacked = set()
    return out


class OffloadGroup:
    """The saved tensors of one call of one unit."""

    def __init__(
        self, session: OffloadSession, name: str, exclude: set[int],
        created: set[int] | None = None,
    ) -> None:  # fmt: skip
        self.session = session
        self.name = name
        self.exclude = exclude
        # Storages the unit's forward created (None: not tracked, anything not excluded).
        self.created = created
        self.entries: dict[int, _Entry] = {}
        # "forward" -> "stashed" (closed, copies started, sources held) -> "host" (sources
        # dropped) -> "loaded" (a load started); or "stashed" -> "loaded" (cancelled).
        self.state = "forward"
        self.offloaded_bytes = 0
        self.touched = False  # unpacked at least once
        self.__weakref__: Any

    def _qualifies(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return False  # parameters and subclasses (fake, DTensor, ...) stay
        if not self.session.backend.accepts(t):
            return False
        storage = t.untyped_storage()
        if storage.nbytes() < self.session.min_bytes:
            return False
        key = storage.data_ptr()
        if self.created is not None and key not in self.created:
            return False  # made outside the unit: held there, saved by reference
        return key not in self.exclude

    def pack(self, t: torch.Tensor) -> Any:
        if self.state != "forward" or not self._qualifies(t):
            return t
        key = storage_key(t)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry(key, t)
            entry.flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                t.untyped_storage()
            )
        handle = _Saved(self, entry, t)
        entry.sources.append((t, t._version))
        entry.handles += 1
        entry.alive += 1
        return handle

    def close(self, output: Any) -> None:
        """End of the unit's forward: move what is not part of the output out."""
        kept = {storage_key(t) for t in _tensors(output)}
        backend = self.session.backend
        for entry in self.entries.values():
            sources, entry.sources = entry.sources, []
            for t, version in sources:
                if t._version != version:
                    raise RuntimeError(
                        f"gradckpt offload: a tensor {self.name} saved for backward was "
                        "modified in place before the end of the unit's forward (autograd "
                        "would fail its version check); do not offload this unit"
                    )
            if entry.key in kept:
                continue  # part of the output: it stays, as autograd would keep it
            entry.ticket = backend.store(entry.flat)
            self.offloaded_bytes += entry.nbytes
        self.state = "stashed"
        self.session.closed(self)

    def drop(self) -> None:
        """The copies out are done (or waited for): drop the sources."""
        for entry in self.entries.values():
            if entry.ticket is not None:
                self.session.backend.stored(entry.ticket)  # after this, the source may be reused
                entry.flat = None
        self.state = "host"
        self.session.events.append(("drop", self.name, None))

    def cancel(self) -> None:
        """Backward reached this group while its sources were still held: use them."""
        for entry in self.entries.values():
            if entry.ticket is not None:
                self.session.backend.discard(entry.ticket)
                entry.ticket = None
        self.state = "loaded"
        self.session.events.append(("load", self.name, "still held"))

    def unpack(self, handle: Any) -> torch.Tensor:
        self.session.before_unpack(self)
        if isinstance(handle, torch.Tensor):
            return handle
        return unpacked(self.session, self.name, handle)

    def load(self, why: str) -> None:
        """Start bringing every offloaded storage of this group back."""
        self.state = "loaded"
        for entry in self.entries.values():
            if entry.ticket is not None and entry.flat is None and entry.pending is None:
                entry.pending = self.session.backend.load(entry.ticket)
        self.session.events.append(("load", self.name, why))


class OffloadSession:
    """Offload state shared by the offloaded units of one model.

    Args:
        backend: where bytes go (:class:`HostCopyBackend` on CPU, the CUDA backend
            on a GPU).
        min_bytes: storages smaller than this stay (per-transfer costs dominate).
        prefetch: load the previous offloaded group when a group is first
            unpacked (False: every load waits for its own unpack).
    """

    def __init__(
        self, backend: OffloadBackend | None = None, *, min_bytes: int = 4096,
        prefetch: bool = True,
    ) -> None:  # fmt: skip
        self.backend = backend if backend is not None else HostCopyBackend()
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.order: list[weakref.ref[OffloadGroup]] = []  # closed groups, forward order
        self.stash: list[weakref.ref[OffloadGroup]] = []  # closed, sources still held
        self.events: list[tuple[str, str, Any]] = []

    def open(self, name: str, exclude: set[int], created: set[int] | None = None) -> OffloadGroup:
        return OffloadGroup(self, name, exclude, created)

    def closed(self, group: OffloadGroup) -> None:
        """``group``'s copies started; the group before it may now drop its sources.

        The forward stash is one group deep: a group's sources stay until the next
        offloaded unit's forward ends, so its copy overlaps that compute.
        """
        self.events.append(("store", group.name, group.offloaded_bytes))
        self._flush(keep=None)
        self.order = [r for r in self.order if r() is not None]
        self.order.append(weakref.ref(group))
        self.stash = [weakref.ref(group)]
        weakref.finalize(group, _discard, group.entries, self.backend)

    def _flush(self, keep: OffloadGroup | None) -> None:
        for ref in self.stash:
            g = ref()
            if g is not None and g.state == "stashed":
                g.cancel() if g is keep else g.drop()
        self.stash = []

    def before_unpack(self, group: OffloadGroup) -> None:
        if group.state == "forward":
            return
        if self.stash:  # the backward has begun
            self._flush(keep=group)
        if not group.touched:  # this group's backward begins
            group.touched = True
            if group.state == "host":
                group.load("demand")
            if self.prefetch:
                self._prefetch_before(group)
            self.events.append(("unpack", group.name, None))

    def _prefetch_before(self, group: OffloadGroup) -> None:
        alive = [g for g in (r() for r in self.order) if g is not None]
        if group not in alive:
            return
        for earlier in reversed(alive[: alive.index(group)]):
            if earlier.state == "host":
                earlier.load("prefetch")
                return


def _discard(entries: dict[int, _Entry], backend: OffloadBackend) -> None:
    """Free a dead group's host copies (its handles are gone: nothing can unpack them)."""
    for entry in entries.values():
        if entry.ticket is not None:
            backend.discard(entry.ticket)
            entry.ticket = None


def _tensors(value: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [x for x in flat if isinstance(x, torch.Tensor)]


def run_offloaded(
    session: OffloadSession,
    name: str,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    keep: tuple[torch.Tensor, ...] = (),
) -> Any:
    """Run ``fn(*args, **kwargs)`` with its saved tensors offloaded through ``session``.

    Only storages that ops of ``fn`` create are offloaded: the storages of tensors
    in ``args``/``kwargs``, of ``keep`` (the unit's parameters and buffers) and
    any other tensor made before the call (module attributes, globals) stay.

    Example:
        >>> out = run_offloaded(session, "layers.0", block, (x,), {}, tuple(block.parameters()))
    """
    exclude = {storage_key(t) for t in (*_tensors((args, kwargs)), *keep)}
    created = CreatedStorages()
    group = session.open(name, exclude, created.keys)
    with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack), created:
        out = fn(*args, **kwargs)
    group.close(out)
    return out
