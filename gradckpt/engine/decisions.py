"""What a policy may answer, what it is told, and how tensors get names.

A policy is a plain callable ``policy(ctx, op, *args, **kwargs) -> Decision``
called once per ATen op of a checkpointed region during the forward pass
(JAX-style: ``jax.checkpoint_policies``). ``SAVE`` keeps the op's outputs
until backward, ``RECOMPUTE`` lets the recompute pass run the op again.

Decisions are typed values shared by every layer (engine policies, plan items,
the simulator, apply): :class:`Keep`, :class:`Recompute`, :class:`Selective`
(a region that keeps the outputs of some of its ops) and :class:`Offload`
(saved tensors moved to host memory, :mod:`gradckpt.engine.offload`). They
are frozen dataclasses, so a decision is data: compared by value, hashed,
written to a plan file by its ``kind`` name. JAX's names (``Saveable``,
``Offloadable``, ``Recompute``) and torch's ``CheckpointPolicy`` values map
onto them. What each kind *does* in the planner and at run time is registered
per kind in ``gradckpt.planning.kinds`` (one module per kind).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

__all__ = [
    "KEEP",
    "RECOMPUTE",
    "SAVE",
    "TAG",
    "Chunk",
    "Decision",
    "Keep",
    "Offload",
    "Offloadable",
    "PolicyContext",
    "Recompute",
    "RecomputeOffload",
    "Saveable",
    "Selective",
    "as_decision",
    "decision_from_json",
    "decision_kind",
    "decision_kinds",
    "engine_decision",
    "forget_decision_kind",
]

D = TypeVar("D", bound="type[Decision]")

# kind name -> Decision class: what a plan file's "mode" names (see decision_from_json).
_KINDS: dict[str, type[Decision]] = {}
# Decision classes a policy may answer per op, i.e. that the engine can run.
_ENGINE: set[type[Decision]] = set()


class Decision:
    """Base of every decision: how a unit (or, for a policy, one op) treats what it saves.

    Subclasses are frozen dataclasses registered under a ``kind`` name with
    :func:`decision_kind`; their fields (if any) are written to plan files by
    :meth:`to_json` and read back by :meth:`from_json`.
    """

    __slots__ = ()
    #: The name plan files and summaries use ("keep", "recompute", ...).
    kind: ClassVar[str] = ""
    #: Non-empty when gradckpt cannot carry out this kind yet: says why and what to do.
    unavailable: ClassVar[str] = ""
    #: The plan-file version a plan holding this kind is written as (see ``Plan.to_json``).
    plan_version: ClassVar[int] = 1

    def to_json(self) -> dict[str, Any]:
        """The decision's own fields for a plan file (besides ``mode``, its kind)."""
        return {}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Decision:
        """The decision a plan file item describes (``data`` holds its fields)."""
        return cls()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def decision_kind(name: str) -> Callable[[D], D]:
    """Class decorator: register a Decision subclass under the kind ``name`` of plan files.

    Example:
        >>> @decision_kind("toy")
        ... @dataclass(frozen=True)
        ... class Toy(Decision): ...
    """

    def register(cls: D) -> D:
        if not (isinstance(cls, type) and issubclass(cls, Decision)):
            raise TypeError(f"decision_kind registers Decision subclasses, got {cls!r}")
        known = _KINDS.get(name)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"the decision kind {name!r} is already {known.__qualname__}")
        cls.kind = name
        _KINDS[name] = cls
        return cls

    return register


def decision_kinds() -> dict[str, type[Decision]]:
    """Every registered kind name and its Decision class, in registration order."""
    return dict(_KINDS)


def forget_decision_kind(name: str) -> None:
    """Unregister a kind (tests that register a toy kind clean up with this)."""
    _KINDS.pop(name, None)


def decision_from_json(mode: str, data: dict[str, Any]) -> Decision:
    """The decision of a plan-file item whose ``mode`` is ``mode``; ValueError if unknown.

    Example:
        >>> decision_from_json("selective", {"save": [1], "save_ops": ["aten.mm.default"]})
        Selective(save=(1,), save_ops=('aten.mm.default',))
    """
    cls = _KINDS.get(mode)
    if cls is None:
        raise ValueError(f"unit mode must be one of {tuple(_KINDS)}, got {mode!r}")
    return cls.from_json(data)


@decision_kind("keep")
@dataclass(frozen=True, slots=True, repr=False)
class Keep(Decision):
    """Keep: a unit runs plainly (autograd keeps what it saves); an op's outputs are kept."""


@decision_kind("recompute")
@dataclass(frozen=True, slots=True, repr=False)
class Recompute(Decision):
    """Recompute: a unit is a checkpointed region (keeps its inputs); an op runs again."""


@decision_kind("selective")
@dataclass(frozen=True, slots=True)
class Selective(Decision):
    """A checkpointed region that keeps the outputs of its ops at positions ``save``.

    ``save_ops`` names those ops (checked when the plan is applied). A unit
    decision only: a per-op policy answers Keep or Recompute.
    """

    save: tuple[int, ...] = ()
    save_ops: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.save) != len(self.save_ops):
            raise ValueError("save and save_ops must have the same length")

    def to_json(self) -> dict[str, Any]:
        return {"save": list(self.save), "save_ops": list(self.save_ops)} if self.save else {}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Selective:
        return cls(tuple(data.get("save", ())), tuple(data.get("save_ops", ())))


@decision_kind("offload")
@dataclass(frozen=True, slots=True, repr=False)
class Offload(Decision):
    """Offload: saved tensors move to host memory after the forward and come back for
    backward (torch's ``MUST_CPU_OFFLOAD``, JAX's ``Offloadable``).

    A unit decision: the unit runs plainly while what it saves goes to host memory
    (:mod:`gradckpt.engine.offload`; which storages move, the link and the host
    budget are the plan's ``offload`` options). Per-op policies cannot answer it.
    """


@decision_kind("recompute_offload")
@dataclass(frozen=True, slots=True)
class RecomputeOffload(Decision):
    """Recompute, with the input the region keeps for its recompute moved to host memory.

    The unit is a checkpointed region (as :class:`Recompute`); the one input it
    keeps that checkpointing could not drop (the tensor at flat position ``arg``
    of its call's arguments: the hidden state a block hands the next) goes to
    host memory after its forward and comes back ahead of its recompute
    (:mod:`gradckpt.engine.offload.boundary`). A unit decision only.
    """

    arg: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.arg, int) or isinstance(self.arg, bool) or self.arg < 0:
            raise ValueError(
                f"RecomputeOffload.arg must be a flat argument position >= 0, got {self.arg!r}"
            )

    def to_json(self) -> dict[str, Any]:
        return {"arg": self.arg} if self.arg else {}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RecomputeOffload:
        return cls(int(data.get("arg", 0)))


@decision_kind("chunk")
@dataclass(frozen=True, slots=True)
class Chunk(Decision):
    """Run the unit, and the loss after it up to the scalar, in ``chunks`` slices of tokens.

    Each slice is a checkpointed region: its intermediates (an LM head's logits,
    their upcast and log-softmax) live only while it runs, in the forward and in
    backward, where slices are recomputed one at a time
    (:mod:`gradckpt.engine.chunking`). Exact up to the order of floating-point
    sums. A unit decision only.
    """

    chunks: int = 2

    #: Plan files that hold this kind are version 2 (older readers refuse them by version).
    plan_version: ClassVar[int] = 2

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 2:
            raise ValueError(f"Chunk.chunks must be an int >= 2, got {self.chunks!r}")

    def to_json(self) -> dict[str, Any]:
        return {"chunks": self.chunks}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Chunk:
        return cls(int(data.get("chunks", 2)))


#: The decisions as a policy returns them (and as plans and the engine compare them).
KEEP = SAVE = Keep()
RECOMPUTE = Recompute()
#: JAX's names (``jax.ad_checkpoint``) for the same decisions.
Saveable = Keep
Offloadable = Offload


def engine_decision(cls: D) -> D:
    """Class decorator: let policies answer ``cls`` per op (the engine can run it).

    Keep and Recompute are the engine's own (``Offload`` is a unit decision: its
    engine moves a whole unit's saved tensors, not one op's).
    """
    _ENGINE.add(cls)
    return cls


engine_decision(Keep)
engine_decision(Recompute)


class _TagOp:
    """The pseudo-op a policy sees when :func:`gradckpt.tag` names a tensor.

    ``policy(ctx, TAG, tensor, name)`` is asked once per tag; ``SAVE`` keeps the
    output of the op that produced ``tensor``.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "gradckpt.TAG"

    def name(self) -> str:
        return "gradckpt::tag"


TAG = _TagOp()


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy knows about the op it decides on.

    Attributes:
        index: position of the op among the region's ATen ops in the forward
            pass (metadata ops such as ``detach`` and ``size`` are not counted).
            Plans refer to ops by this index.
        region: name of the checkpointed region ("" when unnamed).
        output: what the op returned (for shape- or size-aware policies); None
            for the ``TAG`` pseudo-op.
        is_recompute: always False: policies run during the forward pass only.
    """

    index: int
    region: str = ""
    output: Any = None
    is_recompute: bool = False


def _torch_policy_map() -> dict[Any, Decision]:
    try:
        from torch.utils.checkpoint import CheckpointPolicy
    except ImportError:  # pragma: no cover - torch without SAC
        return {}
    return {
        CheckpointPolicy.MUST_SAVE: SAVE,
        CheckpointPolicy.PREFER_SAVE: SAVE,
        CheckpointPolicy.MUST_RECOMPUTE: RECOMPUTE,
        CheckpointPolicy.PREFER_RECOMPUTE: RECOMPUTE,
        CheckpointPolicy.MUST_CPU_OFFLOAD: Offload(),
    }


_TORCH_POLICIES = _torch_policy_map()


def _policy_name(policy: Any) -> str:
    return getattr(policy, "__name__", repr(policy))


def as_decision(value: Any, op: Any, policy: Any) -> Decision:
    """Turn a policy's answer into a Decision, or raise a TypeError naming the op.

    Accepts ``SAVE``/``RECOMPUTE`` (any ``Keep()``/``Recompute()``), a bool (True
    means save, as in JAX and torch) and torch's ``CheckpointPolicy`` values, so
    torch SAC policies work unchanged. Keep and Recompute come back as the
    ``SAVE``/``RECOMPUTE`` objects, so the engine may compare with ``is``. A
    kind the engine cannot run per op (a unit-only kind such as ``Selective`` or
    ``Offload``) raises a NotImplementedError/TypeError saying so.

    Example:
        >>> as_decision(True, op, policy) is SAVE
        True
    """
    if value is SAVE or value is RECOMPUTE:
        return value
    if isinstance(value, bool):
        return SAVE if value else RECOMPUTE
    if isinstance(value, Decision):
        decision = value
    elif isinstance(value, torch.Tensor):
        decision = None
    else:
        try:
            decision = _TORCH_POLICIES.get(value)
        except TypeError:  # unhashable: not a CheckpointPolicy either
            decision = None
    if decision is not None:
        cls = type(decision)
        if cls is Keep:
            return SAVE
        if cls is Recompute:
            return RECOMPUTE
        if cls in _ENGINE:
            return decision
        if cls.unavailable:
            raise NotImplementedError(
                f"checkpoint policy {_policy_name(policy)} returned {value!r} for op {op}: "
                f"{cls.unavailable}"
            )
        raise TypeError(
            f"checkpoint policy {_policy_name(policy)} returned {value!r} for op {op}, a "
            f"decision for whole units (a plan's {cls.kind!r}), not for one op; a policy "
            "returns gradckpt.SAVE or gradckpt.RECOMPUTE"
        )
    raise TypeError(
        f"checkpoint policy {_policy_name(policy)} returned {value!r} for op {op}; a policy "
        "must return gradckpt.SAVE or gradckpt.RECOMPUTE (a bool or torch's CheckpointPolicy "
        "also works)"
    )
