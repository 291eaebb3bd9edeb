"""The key of a model call: what identifies "the same shape" cheaply on every call.

A plan is made for one step at one shape; its predicted peak holds only there.
:class:`ShapeKey` holds the shape, dtype and grad flag of every tensor reachable
in the call's arguments (through dicts, lists, tuples and dataclasses, at any
depth) and the values of its plain arguments (ints, floats, bools, strings),
each by its place in the call. It is plain data: a
:class:`~gradckpt.planning.plans.planset.PlanSet` saves its plans under their
keys, and the shape guard compares each call's key with its plan's.

Example:
    >>> shape_key((torch.zeros(4, 3),), {"mask": None}).describe()
    '(4,3):float32'
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "CallsKey",
    "Key",
    "ShapeKey",
    "Sig",
    "TensorSig",
    "as_written",
    "calls_of",
    "key_from_json",
    "shape_key",
    "step_key",
]


@dataclass(frozen=True)
class TensorSig:
    """One input leaf: a tensor's shape, dtype and whether it requires grad.

    A plain value (an int, a flag, a string) is a leaf of shape ``()`` whose
    ``dtype`` holds its type and value (``"int=128"``); a container (a dict, a
    list, a dataclass) is a marker ``"{dict}"`` whose leaves follow it by path;
    an argument the key cannot read is ``"?TypeName"``. So a key stays plain data
    (saved as JSON with its plans) and any change of a value is a change of key.
    """

    shape: tuple[int, ...]
    dtype: str
    grad: bool = False

    @property
    def kind(self) -> str:
        """``"tensor"``, ``"value"``, ``"container"`` or ``"unread"``."""
        if self.dtype.startswith("{"):
            return "container"
        if self.dtype.startswith("?"):
            return "unread"
        return "value" if "=" in self.dtype else "tensor"

    def describe(self) -> str:
        kind = self.kind
        if kind == "value":
            return self.dtype.partition("=")[2]
        if kind == "unread":
            return f"<{self.dtype[1:]}, not read>"
        if kind == "container":
            return self.dtype
        dims = ",".join(str(d) for d in self.shape)
        return f"({dims}):{self.dtype.removeprefix('torch.')}" + (" grad" if self.grad else "")


# None: the value None (in keys saved before plain values were read: any non-tensor argument)
Sig = TensorSig | None


@dataclass(frozen=True)
class ShapeKey:
    """The shapes of one model call: positional leaves, then named leaves by name.

    ``args`` has one entry per positional argument; ``kwargs`` holds the keyword
    arguments by name and the leaves inside containers by path (``"[0].input_ids"``
    for ``model(batch)``, ``"inputs.mask"`` for ``model(inputs={"mask": m})``).

    Example:
        >>> shape_key((), {"input_ids": torch.zeros(2, 8, dtype=torch.long)}).describe()
        'input_ids=(2,8):int64'
    """

    args: tuple[Sig, ...]
    kwargs: tuple[tuple[str, Sig], ...] = ()

    def describe(self) -> str:
        parts = [s.describe() if s is not None else "-" for s in self.args if not _container(s)]
        parts += [
            f"{k}={s.describe() if s is not None else 'None'}"
            for k, s in self.kwargs
            if not _container(s)
        ]
        return ", ".join(parts) if parts else "(no inputs)"

    def unread(self) -> list[str]:
        """The arguments the key could not read, as ``"where (type)"``: their content is not in it."""
        named = [(f"[{i}]", s) for i, s in enumerate(self.args)] + list(self.kwargs)
        return [f"{k} ({s.dtype[1:]})" for k, s in named if s is not None and s.kind == "unread"]

    def _sigs(self) -> list[Sig]:
        return [*self.args, *(s for _, s in self.kwargs)]

    def bounded_by(self, other: ShapeKey | CallsKey) -> bool:
        """Same inputs, dtypes and ranks as ``other``, and no dimension larger."""
        if not isinstance(other, ShapeKey):
            return False
        if len(self.args) != len(other.args) or [k for k, _ in self.kwargs] != [
            k for k, _ in other.kwargs
        ]:
            return False
        for mine, theirs in zip(self._sigs(), other._sigs()):
            if (mine is None) != (theirs is None):
                return False
            if mine is None or theirs is None:
                continue
            if (mine.dtype, mine.grad, len(mine.shape)) != (
                theirs.dtype,
                theirs.grad,
                len(theirs.shape),
            ):
                return False
            if any(a > b for a, b in zip(mine.shape, theirs.shape)):
                return False
        return True

    def numel(self) -> int:
        """Elements over all tensor inputs (orders bounding keys from smallest)."""
        total = 0
        for sig in self._sigs():
            if sig is not None:
                n = 1
                for d in sig.shape:
                    n *= d
                total += n
        return total

    def to_json(self) -> dict[str, Any]:
        def sig(s: Sig) -> Any:
            return None if s is None else [list(s.shape), s.dtype, s.grad]

        return {
            "args": [sig(s) for s in self.args],
            "kwargs": [[k, sig(s)] for k, s in self.kwargs],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShapeKey:
        def sig(s: Any) -> Sig:
            return None if s is None else TensorSig(tuple(s[0]), s[1], bool(s[2]))

        return cls(
            tuple(sig(s) for s in data["args"]), tuple((k, sig(s)) for k, s in data["kwargs"])
        )


@dataclass(frozen=True)
class CallsKey:
    """The shapes of a step that calls the model several times, in call order.

    A bi-encoder runs its anchors and then its positives through one model; a
    step at (16 tokens, then 48) and one at (48, then 16) keep different tensors,
    so each order is its own key. A step of one call is keyed by that call's
    :class:`ShapeKey` alone (:func:`step_key`).

    Example:
        >>> a, b = shape_key((torch.zeros(8, 16),), {}), shape_key((torch.zeros(8, 48),), {})
        >>> step_key([a, b]).describe()
        '(8,16):float32 then (8,48):float32'
    """

    calls: tuple[ShapeKey, ...]

    def describe(self) -> str:
        return " then ".join(k.describe() for k in self.calls)

    def unread(self) -> list[str]:
        return list(dict.fromkeys(u for k in self.calls for u in k.unread()))

    def bounded_by(self, other: Key) -> bool:
        """As many calls as ``other``, each bounded by its counterpart."""
        theirs = calls_of(other)
        return len(theirs) == len(self.calls) and all(
            mine.bounded_by(t) for mine, t in zip(self.calls, theirs)
        )

    def numel(self) -> int:
        return sum(k.numel() for k in self.calls)

    def to_json(self) -> dict[str, Any]:
        return {"calls": [k.to_json() for k in self.calls]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CallsKey:
        return cls(tuple(ShapeKey.from_json(k) for k in data["calls"]))


#: The key of a step: its one call's shapes, or the shapes of each of its calls.
Key = ShapeKey | CallsKey


def step_key(calls: list[ShapeKey] | tuple[ShapeKey, ...]) -> Key:
    """The key of a step that made ``calls`` (one call: that call's key).

    Example:
        >>> step_key([k]) is k
        True
    """
    if not calls:
        raise ValueError("a step key needs at least one call")
    return calls[0] if len(calls) == 1 else CallsKey(tuple(calls))


def calls_of(key: Key) -> tuple[ShapeKey, ...]:
    """The call keys of a step key, in order (one for a :class:`ShapeKey`).

    Example:
        >>> calls_of(step_key([a, b])) == (a, b)
        True
    """
    return key.calls if isinstance(key, CallsKey) else (key,)


def key_from_json(data: dict[str, Any]) -> Key:
    """A :class:`ShapeKey` or :class:`CallsKey` from its JSON."""
    return CallsKey.from_json(data) if "calls" in data else ShapeKey.from_json(data)


def _container(sig: Sig) -> bool:
    return sig is not None and sig.kind == "container"


# Enough for any batch a model takes; deeper or larger structures are not read (and said so).
_MAX_DEPTH = 6
_MAX_LEAVES = 512
_MAX_STR = 64


def _value(x: Any) -> Sig | None:
    """The leaf of a plain value, or None when ``x`` is not one."""
    if isinstance(x, numbers.Number):
        return TensorSig((), f"{type(x).__name__}={x!r}")
    if isinstance(x, str):
        # A long string (a prompt, a path) keys by its length and checksum: short keys.
        shown = (
            repr(x) if len(x) <= _MAX_STR else f"<str len {len(x)} crc {zlib.crc32(x.encode())}>"
        )
        return TensorSig((), f"str={shown}")
    if isinstance(x, (torch.dtype, torch.device, enum.Enum)):
        return TensorSig((), f"{type(x).__name__}={x}")
    return None


def _leaf(x: Any, path: str, named: list[tuple[str, Sig]], depth: int) -> Sig:
    """The sig of ``x`` at ``path``; a container's leaves go to ``named`` by their paths."""
    if isinstance(x, torch.Tensor):
        return TensorSig(tuple(x.shape), str(x.dtype).removeprefix("torch."), x.requires_grad)
    if x is None:
        return None
    value = _value(x)
    if value is not None:
        return value
    items: list[tuple[str, Any]] | None = None
    if isinstance(x, Mapping):
        items = sorted(((f"{path}.{k}", v) for k, v in x.items()), key=lambda kv: kv[0])
    elif isinstance(x, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(x)]
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        items = [(f"{path}.{f.name}", getattr(x, f.name)) for f in dataclasses.fields(x)]
    name = type(x).__name__
    if items is None or depth >= _MAX_DEPTH or len(named) + len(items) > _MAX_LEAVES:
        return TensorSig((), f"?{name}")
    for where, v in items:
        named.append((where, _leaf(v, where, named, depth + 1)))
    return TensorSig((), f"{{{name}}}")


def shape_key(args: tuple, kwargs: dict[str, Any]) -> ShapeKey:
    """The :class:`ShapeKey` of a call ``model(*args, **kwargs)``; microseconds per call.

    Every tensor reachable in the arguments counts (dicts, lists, tuples and
    dataclasses are walked), and so does every plain value: a length, a flag or
    a mode string can change what the step keeps. A keyword argument set to
    None counts as not passed. Anything else (an arbitrary object) is recorded
    by its type only; :meth:`ShapeKey.unread` names it.

    Example:
        >>> shape_key((torch.zeros(4, 3),), {}).describe()
        '(4,3):float32'
    """
    named: list[tuple[str, Sig]] = []
    positional = tuple(_leaf(a, f"[{i}]", named, 1) for i, a in enumerate(args))
    for k, v in kwargs.items():
        if v is not None:  # None is every keyword's usual default: passing it changes nothing
            named.append((k, _leaf(v, k, named, 1)))
    # Sorted by name: the order a caller writes keywords (or a dict's keys) in is no new shape.
    return ShapeKey(positional, tuple(sorted(named, key=lambda kv: kv[0])))


def as_written(model: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` less the values gradckpt's own forward pre-hooks put there.

    Such a hook (``use_cache=False`` for training calls of a transformers model)
    runs before the guard; the fitted call was recorded without it, and the same
    call must keep the same key. A hook says what it sets in ``gradckpt_sets``.
    """
    for hook in model._forward_pre_hooks.values():
        for name, value in getattr(hook, "gradckpt_sets", {}).items():
            if name in kwargs and kwargs[name] is value:
                kwargs = {k: v for k, v in kwargs.items() if k != name}
    return kwargs
