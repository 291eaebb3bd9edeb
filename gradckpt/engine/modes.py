"""Dispatch modes that run below autograd inside a region.

* :class:`PolicyMode` asks the region's policy about every op during the
  forward and keeps the outputs of ``SAVE`` ops.
* :class:`RecomputeMode` runs during the recompute: it replays kept outputs
  instead of running their ops again, and keeps the recompute from writing to
  state that existed before it started (BatchNorm running statistics, counters),
  so module side effects happen once per step, not twice (pytorch#96136).
* :class:`OpLogMode` records op names for ``debug=True`` error messages.

Op positions are counted identically by all of them and by the profiler
(:func:`counts_as_op`), so a plan can name ops by index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from gradckpt.engine.decisions import RECOMPUTE, SAVE, PolicyContext, as_decision

if TYPE_CHECKING:
    from gradckpt.engine.frame import Frame

__all__ = [
    "OpLogMode",
    "PolicyMode",
    "RecomputeMode",
    "counts_as_op",
    "replay_key",
    "written_args",
]

aten = torch.ops.aten

# Metadata-only ops and the detaches autograd and our hooks issue: they allocate
# nothing, cost nothing, and may differ between the forward and the recompute.
_UNCOUNTED = {
    aten.detach.default,
    aten.size.default,
    aten.sym_size.default,
    aten.stride.default,
    aten.sym_stride.default,
    aten.numel.default,
    aten.sym_numel.default,
    aten.dim.default,
    aten.storage_offset.default,
    aten.sym_storage_offset.default,
    aten.is_contiguous.default,
    aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default,
    aten.is_non_overlapping_and_dense.default,
    torch.ops.prim.device.default,
}


def counts_as_op(func: Any) -> bool:
    """Whether an op gets a position in a region (plans index ops by it)."""
    return func not in _UNCOUNTED


class _OpInfo:
    """What the modes ask about an op on every dispatch, worked out once per op."""

    __slots__ = ("call", "counted", "func", "kept", "key", "writes")

    def __init__(self, func: Any) -> None:
        self.func = func  # keeps the op, hence its id, alive
        self.key = id(func)  # hashing an OpOverload runs Python; its id does not
        # OpOverload.__call__ is a Python frame around ``_op``: call that directly.
        self.call = func._op if type(func) is torch._ops.OpOverload else func
        self.counted = func not in _UNCOUNTED
        # View ops cost nothing and alias their input: rerun, never kept (see replay_key).
        self.kept = self.counted and not _is_view(func)
        self.writes = _schema_writes(func)


_INFO: dict[int, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    info = _INFO.get(id(func))
    if info is None or info.func is not func:
        info = _INFO[id(func)] = _OpInfo(func)
    return info


def _undeclared_writes() -> dict[Any, tuple[int, ...]]:
    # Batch norm kernels update running_mean/running_var (arguments 3 and 4) in
    # place without saying so in their schemas.
    found = {}
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"):
        packet = getattr(aten, name, None)
        if packet is not None:
            found[packet.default] = (3, 4)
    return found


_UNDECLARED_WRITES = _undeclared_writes()


def written_args(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positions and keyword names of the arguments an op writes to, from its schema.

    Worked out once per op, in the modes' per-op cache (the profiler asks on every op).

    Example:
        >>> written_args(torch.ops.aten.add_.Tensor)
        ((0,), ())
    """
    return _op_info(func).writes


def _schema_writes(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    positions, names = [], []
    schema = getattr(func, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        info = arg.alias_info
        if info is not None and info.is_write:
            if arg.kwarg_only:
                names.append(arg.name)
            else:
                positions.append(i)
    positions.extend(_UNDECLARED_WRITES.get(func, ()))
    return tuple(sorted(set(positions))), tuple(names)


def _storage_key(t: torch.Tensor) -> int:
    # The storage's identity, not its data pointer: that is 0 for every fake or
    # meta storage.
    return t.untyped_storage()._cdata


def _detach_keeping_version(x: Any) -> Any:
    # Below autograd, ADInplaceOrView is excluded; re-enable it so the detached
    # alias shares the version counter and later in-place writes stay visible.
    if isinstance(x, torch.Tensor):
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            return x.detach()
    return x


def _is_view(func: Any) -> bool:
    return bool(getattr(func, "is_view", False))


def replay_key(op: Any, occurrences: dict[Any, int]) -> tuple[Any, int]:
    """Key of a kept output: the op and how many times it ran before in the region.

    ``op`` names the op: the modes pass its ``id`` (an OpOverload hashes in Python).

    The recompute finds kept outputs by this key, as torch's selective
    checkpointing does, not by the op's position: tools that hook module calls
    (FlopCounterMode, ModuleTracker, FSDP2 run ``register_multi_grad_hook``,
    hence ``t.view_as(t)`` on leaf inputs) add ops to a recompute that its
    forward did not run, and a shifted position would replay one layer's output
    into the next identical layer. View ops take no part: they cost nothing, so
    they are rerun rather than kept.
    """
    n = occurrences.get(op, 0)
    occurrences[op] = n + 1
    return (op, n)


class CacheEntry:
    """Outputs of a SAVE op, with the versions they had when kept."""

    __slots__ = ("func", "outputs", "versions")

    def __init__(self, func: Any, outputs: Any) -> None:
        self.func = func
        if type(outputs) is torch.Tensor:  # the common case, without pytree's walk
            self.outputs = _detach_keeping_version(outputs)
            self.versions = (outputs._version,)
            return
        self.outputs = tree_map(_detach_keeping_version, outputs)
        flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        self.versions = tuple(t._version if isinstance(t, torch.Tensor) else None for t in flat)

    def intact(self) -> bool:
        flat = self.outputs if isinstance(self.outputs, (tuple, list)) else (self.outputs,)
        return all(v is None or t._version == v for t, v in zip(flat, self.versions))

    def replay(self) -> Any:
        """A fresh alias of the kept outputs (autograd attaches the recompute's graph to it)."""
        if type(self.outputs) is torch.Tensor:
            return _detach_keeping_version(self.outputs)
        return tree_map(_detach_keeping_version, self.outputs)


class PolicyMode(TorchDispatchMode):
    """Forward of a region with a policy: number ops, ask the policy, keep SAVE outputs."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.frame = frame
        self.occurrences: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The hot path of a selective region's forward: one call per op, so the
        # op's facts come from _op_info and nothing here hashes the op itself.
        kwargs = kwargs or {}
        info = _op_info(func)
        out = info.call(*args, **kwargs)
        if info.counted:
            frame = self.frame
            index = frame.op_count
            frame.op_count = index + 1
            ctx = PolicyContext(index=index, region=frame.name, output=out)
            policy = frame.policy
            decision = policy(ctx, func, *args, **kwargs)
            if decision is not SAVE and decision is not RECOMPUTE:
                decision = as_decision(decision, func, policy)
            if not info.kept:
                return out  # a view: free to redo and aliases its input (see replay_key)
            key = replay_key(info.key, self.occurrences)
            if decision is SAVE:
                frame.cache[key] = CacheEntry(func, out)
            elif isinstance(out, torch.Tensor):
                frame.note_producer(out, key, func)
        return out


class RecomputeMode(TorchDispatchMode):
    """Recompute of a region: replay kept outputs, never write to pre-existing state."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.frame = frame
        self.occurrences: dict[Any, int] = {}
        self.local: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = _op_info(func)
        if not info.kept:
            return info.call(*args, **kwargs)
        cache = self.frame.cache  # empty for plain checkpointing: no key to count then
        if cache:
            entry = cache.get(replay_key(info.key, self.occurrences))
            if entry is not None and entry.func is func and entry.intact():
                # A fresh alias each time: autograd attaches this recompute's graph to
                # the returned tensor, and the cache must not keep that graph alive.
                return entry.replay()
        positions, names = info.writes
        if positions or names:
            args, kwargs = self._redirect_writes(args, kwargs, positions, names)
        out = info.call(*args, **kwargs)
        local = self.local
        if type(out) is torch.Tensor:
            local.add(out.untyped_storage()._cdata)  # _storage_key, inlined: once per op
        else:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    local.add(_storage_key(t))
        return out

    def _redirect_writes(self, args, kwargs, positions, names):
        # A write to a tensor this recompute did not create (a buffer, a parameter,
        # a region input) already happened in the forward: aim it at a copy.
        def private(t):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in self.local:
                copy = t.clone()
                self.local.add(_storage_key(copy))
                return copy
            return t

        if positions:
            args = list(args)
            for i in positions:
                if i < len(args):
                    args[i] = private(args[i])
        if names:
            kwargs = dict(kwargs)
            for name in names:
                if name in kwargs:
                    kwargs[name] = private(kwargs[name])
        return args, kwargs


class OpLogMode(TorchDispatchMode):
    """Record the names of the ops a region runs (for ``debug=True``)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _UNCOUNTED:
            self.log.append(str(func))
        return func(*args, **(kwargs or {}))
