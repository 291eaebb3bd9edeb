"""Count the tensor storages that ops allocate, and notice when they are freed.

:class:`StorageWatcher` is the one place that decides what "allocated bytes"
means, so the :class:`~gradckpt.measure.MemoryTracker` and the planner's
profiler count identically. It is fed every op's outputs from a
``TorchDispatchMode`` and

* counts an output as a new allocation only if the op's schema says the return
  is not an alias of an input (views, in-place and ``out=`` ops allocate
  nothing), once per storage (several outputs, or views, may share one), and
  never a zero-byte storage;
* learns of the free through a weak reference to the storage's Python object:
  torch keeps that object alive exactly as long as the storage (also for
  ``FakeTensor`` and meta storages, whose ``nbytes()`` is the size the real
  storage would have), so the callback fires when the memory is released.

Limitations: allocations made outside the dispatcher (inside a kernel, under
``no_dispatch``) are invisible; so is the growth of a storage that existed
before it was watched when an ``out=`` op or ``resize_`` enlarges it (the growth
of a watched storage is counted); tensor subclasses without a real storage
(wrapper subclasses such as DTensor) and sparse tensors are skipped. Under a
``FakeTensorMode`` with a ``ShapeEnv`` (symbolic sizes) byte counts become
``SymInt`` expressions and peak comparisons add guards; plan with static fake
shapes (the default). Frees are
reported on the thread that drops the last reference; the watcher takes no lock
because torch runs one op at a time per backward on CPU and the frees it sees
happen between ops.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["StorageWatcher", "storage_key"]

aten = torch.ops.aten

# How an op's return relates to its inputs, from its schema annotation.
_VIEW = 0  # `Tensor(a)`: shares an input's storage, allocates nothing
_FRESH = 1  # no annotation: a new storage
_WRITTEN = 2  # `Tensor(a!)`: in-place or out=; may have been resized

# Ops whose schema promises a fresh tensor but whose kernel returns a view of
# the input (matmul and reshape use it on their own temporaries).
_SCHEMA_VIEWS = {aten._unsafe_view.default}

_KINDS: dict[Any, tuple[int, ...]] = {}
_ALL_VIEWS = ()  # marker: no return can allocate; the fast path for views


def _return_kinds(func: Any) -> tuple[int, ...]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return (_FRESH,)  # no schema (unknown callable): dedupe by storage still applies
    if func in _SCHEMA_VIEWS:
        return _ALL_VIEWS
    kinds = []
    for ret in schema.returns:
        info = ret.alias_info
        if info is None:
            kinds.append(_FRESH)
        else:
            kinds.append(_WRITTEN if info.is_write else _VIEW)
    if all(k == _VIEW for k in kinds):
        return _ALL_VIEWS
    return tuple(kinds)


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, shared by all its views.

    Example:
        >>> x = torch.empty(4)
        >>> storage_key(x) == storage_key(x.view(2, 2))
        True
    """
    return t.untyped_storage()._cdata


def _tensors(out: Any, kinds: tuple[int, ...]) -> Iterator[tuple[torch.Tensor, int]]:
    # A `Tensor[]` return is one schema return holding many tensors; a tuple
    # return has one schema entry per element (which may itself be a list).
    if not isinstance(out, (tuple, list)):
        return
    single = len(kinds) == 1
    for i, item in enumerate(out):
        kind = kinds[0] if single else kinds[i] if i < len(kinds) else _FRESH
        if isinstance(item, torch.Tensor):
            yield item, kind
        elif isinstance(item, (tuple, list)):
            for t in item:
                if isinstance(t, torch.Tensor):
                    yield t, kind


class StorageWatcher:
    """Live bytes of the storages created by the ops it is shown.

    Args:
        on_alloc: called as ``on_alloc(key, nbytes)`` after a new storage is counted.
        on_free: called as ``on_free(key)`` after a counted storage is released.

    ``key`` is :func:`storage_key` of the storage; a key may be reused by a later
    storage once its ``on_free`` has been reported. A watched storage that an
    in-place/``out=`` op resizes is reported as ``on_free(key)`` then
    ``on_alloc(key, new_nbytes)``.

    Example:
        >>> watcher = StorageWatcher()
        >>> class Watch(TorchDispatchMode):
        ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ...         out = func(*args, **(kwargs or {}))
        ...         watcher.observe(func, out)
        ...         return out
        >>> with Watch():
        ...     x = torch.empty(256)
        >>> watcher.live_bytes
        1024
    """

    def __init__(
        self,
        on_alloc: Callable[[int, int], None] | None = None,
        on_free: Callable[[int], None] | None = None,
    ) -> None:
        self._on_alloc = on_alloc
        self._on_free = on_free
        self._refs: dict[int, weakref.KeyedRef] = {}
        self._sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.cuda_device: int | None = None  # first CUDA device an allocation was seen on

    def observe(self, func: Any, out: Any) -> None:
        """Account for the outputs ``out`` of one call of the ATen op ``func``."""
        kinds = _KINDS.get(func)
        if kinds is None:
            kinds = _KINDS[func] = _return_kinds(func)
        if kinds is _ALL_VIEWS:
            return
        if isinstance(out, torch.Tensor):  # the common case, without a generator
            kind = kinds[0]
            if kind == _FRESH:
                self.track(out)
            elif kind == _WRITTEN:
                self._check_resize(out)
            return
        for t, kind in _tensors(out, kinds):
            if kind == _FRESH:
                self.track(t)
            elif kind == _WRITTEN:
                self._check_resize(t)

    def track(self, t: torch.Tensor) -> bool:
        """Count ``t``'s storage as allocated now; False if known, empty or storage-less.

        The profiler uses this to register tensors it knows are new (e.g. inputs
        it creates itself); :meth:`observe` calls it for fresh op outputs.
        """
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return False  # sparse tensors, wrapper subclasses without data
        key = storage._cdata
        if key in self._sizes:
            return False
        nbytes = storage.nbytes()
        if nbytes == 0:
            return False
        self._refs[key] = weakref.KeyedRef(storage, self._released, key)
        self._sizes[key] = nbytes
        live = self.live_bytes + nbytes
        self.live_bytes = live
        if live > self.peak_bytes:
            self.peak_bytes = live
        if self.cuda_device is None and t.is_cuda:
            self.cuda_device = t.get_device()
        if self._on_alloc is not None:
            self._on_alloc(key, nbytes)
        return True

    def _check_resize(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        key = storage._cdata
        old = self._sizes.get(key)
        if old is None:
            return
        new = storage.nbytes()
        if new == old:
            return
        self._sizes[key] = new
        self.live_bytes += new - old
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if self._on_free is not None:
            self._on_free(key)
        if self._on_alloc is not None:
            self._on_alloc(key, new)

    def _released(self, ref: weakref.KeyedRef) -> None:
        key = ref.key
        nbytes = self._sizes.pop(key, None)
        if nbytes is None:
            return  # closed meanwhile
        del self._refs[key]
        self.live_bytes -= nbytes
        if self._on_free is not None:
            self._on_free(key)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def nbytes(self, key: int) -> int:
        """Bytes of the live watched storage ``key`` (KeyError if not watched)."""
        return self._sizes[key]

    def keys(self) -> list[int]:
        """Keys of the watched storages that are alive now."""
        return list(self._sizes)

    def close(self) -> None:
        """Stop watching: frees after this are not reported (``live_bytes`` stays as is)."""
        self._sizes.clear()
        # Dropping the weak references cancels their callbacks.
        self._refs.clear()

    def __repr__(self) -> str:
        return (
            f"StorageWatcher(live={self.live_bytes} B in {len(self._sizes)} storages, "
            f"peak={self.peak_bytes} B)"
        )
