"""Plans per input shape: the key of a model call, a set of plans keyed by it, and the
proof that lets a smaller shape run under a larger shape's plan.

A plan is made for one step at one shape; its predicted peak holds only there.
:class:`ShapeKey` is what identifies "the same shape" cheaply on every call: the
shape, dtype and grad flag of every tensor reachable in the call's arguments
(through dicts, lists, tuples and dataclasses, at any depth) and the values of
its plain arguments (ints, floats, bools, strings), each by its place in the call. A :class:`PlanSet` maps
keys to plans made under one budget and saves them as one versioned JSON file;
single-plan files still load into a one-plan set.

Example:
    >>> plans = gradckpt.plan(model, loss_fn, "3GiB", shapes=[128, 256, 512])
    >>> plans.save("plans.json"); plans = gradckpt.PlanSet.load("plans.json")
"""

from __future__ import annotations

import dataclasses
import enum
import json
import numbers
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradckpt._versioned import check_header
from gradckpt.planning.plans.plan import Plan
from gradckpt.profiling.records import Profile

__all__ = [
    "PLANSET_VERSION",
    "PlanSet",
    "ShapeKey",
    "TensorSig",
    "as_written",
    "load_plans",
    "proves_monotone",
    "same_event_line",
    "shape_key",
]

PLANSET_VERSION = 1


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

    def bounded_by(self, other: ShapeKey) -> bool:
        """Same inputs, dtypes and ranks as ``other``, and no dimension larger."""
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


@dataclass(frozen=True)
class PlanSet:
    """Plans for one model under one budget, keyed by the shape of the model call.

    ``entries`` hold ``(key, plan)`` pairs; a key of None marks a plan loaded from a
    single-plan file, whose call shape was not recorded.

    Example:
        >>> plans = gradckpt.plan(model, loss_fn, "3GiB", shapes=[128, 512])
        >>> plans.get(gradckpt.planning.plans.planset.shape_key((), batch)).predicted_peak_bytes
    """

    entries: tuple[tuple[ShapeKey | None, Plan], ...]
    version: int = PLANSET_VERSION

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("a plan set holds at least one plan")
        fingerprints = {plan.fingerprint for _, plan in self.entries}
        if len(fingerprints) != 1:
            raise ValueError(
                f"a plan set is for one model; got fingerprints {sorted(fingerprints)}"
            )
        keys = [k for k, _ in self.entries]
        if len(set(keys)) != len(keys):
            raise ValueError("a plan set holds one plan per shape; a shape is listed twice")

    @property
    def fingerprint(self) -> str:
        return self.entries[0][1].fingerprint

    @property
    def budget_bytes(self) -> int | None:
        return self.entries[0][1].budget_bytes

    @property
    def plans(self) -> dict[ShapeKey | None, Plan]:
        return dict(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[tuple[ShapeKey | None, Plan]]:
        return iter(self.entries)

    def get(self, key: ShapeKey) -> Plan | None:
        """The plan made for exactly ``key``, or None."""
        return self.plans.get(key)

    def bounding(self, key: ShapeKey) -> tuple[ShapeKey, Plan] | None:
        """The smallest planned shape that bounds ``key`` in every dimension, with its plan."""
        found = [(k, p) for k, p in self.entries if k is not None and key.bounded_by(k)]
        return min(found, key=lambda kp: kp[0].numel()) if found else None  # fewest elements

    def summary(self) -> str:
        """One line per shape: predicted peak against the budget."""
        from gradckpt.measure.memory import format_bytes

        lines = []
        for key, plan in self.entries:
            where = key.describe() if key is not None else "(shape not recorded)"
            budget = format_bytes(plan.budget_bytes) if plan.budget_bytes else "-"
            lines.append(
                f"{where}: predicted peak {format_bytes(plan.predicted_peak_bytes)} "
                f"(budget {budget}), overhead {plan.predicted_overhead:+.1%}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "gradckpt.PlanSet",
            "version": self.version,
            "entries": [
                {"shape": k.to_json() if k is not None else None, "plan": p.to_json()}
                for k, p in self.entries
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanSet:
        """A set from its JSON; a single plan's JSON becomes a one-plan set (key None)."""
        if data.get("kind") == "gradckpt.Plan":
            return cls(((None, Plan.from_json(data)),))
        check_header(data, "gradckpt.PlanSet", PLANSET_VERSION, "plan the model again")
        return cls(
            tuple(
                (
                    ShapeKey.from_json(e["shape"]) if e["shape"] is not None else None,
                    Plan.from_json(e["plan"]),
                )
                for e in data["entries"]
            )
        )

    def save(self, path: str | Path) -> None:
        """Write the set as JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> PlanSet:
        """Read a set written by :meth:`save`, or a single plan written by ``Plan.save``."""
        return cls.from_json(json.loads(Path(path).read_text()))


def load_plans(path: str | Path) -> Plan | PlanSet:
    """Whatever plan file ``path`` holds: a :class:`Plan` or a :class:`PlanSet`.

    Example:
        >>> gradckpt.apply(model, load_plans("plans.json"))
    """
    data = json.loads(Path(path).read_text())
    if data.get("kind") == "gradckpt.PlanSet":
        return PlanSet.from_json(data)
    return Plan.from_json(data)


def same_event_line(a: Profile, b: Profile) -> bool:
    """True when two profiles differ at most in sizes: bytes, FLOPs, times, shapes.

    Same ops in the same order (names, units, positions, outputs), same storages
    made and freed at the same positions, same tensors saved, unpacked and
    released at the same positions, same units.
    """
    if (a.forward_ops, a.end, a.param_bytes) != (b.forward_ops, b.end, b.param_bytes):
        return False
    shape = {  # the fields of each record kind that make up the event line
        "ops": attrgetter("name", "backward", "unit", "local", "outputs", "position"),
        "storages": attrgetter("producer", "alloc", "free", "natural_free", "mutated"),
        "packs": attrgetter("storage", "unit", "ops_done", "position", "unpack", "release"),
        "units": attrgetter(
            "path", "first_op", "end_op", "chain_input", "output", "chained", "calls"
        ),
    }
    for kind, fields in shape.items():
        xs, ys = getattr(a, kind), getattr(b, kind)
        if len(xs) != len(ys) or any(fields(x) != fields(y) for x, y in zip(xs, ys)):
            return False
    return True


def proves_monotone(small: Profile, large: Profile) -> bool:
    """True when any plan's peak on ``small`` is at most its peak on ``large``.

    The simulator predicts a plan's peak from the event line (which storages are
    made, saved, unpacked and freed, in what order) and each storage's bytes. If
    the two steps have the same event line and every storage of ``small`` is no
    larger than its counterpart in ``large``, then at every position of every
    plan's line the live bytes on ``small`` are at most those on ``large``, so
    the peak is too. Tests use this to show that a model family may run a
    shorter sequence under a longer one's plan.

    Example:
        >>> proves_monotone(gradckpt.profile(m, at_128, fake=True), gradckpt.profile(m, at_512, fake=True))
        True
    """
    return same_event_line(small, large) and all(
        s.nbytes <= t.nbytes for s, t in zip(small.storages, large.storages)
    )


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
