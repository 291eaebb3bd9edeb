"""What a policy may answer, what it is told, and how tensors get names.

A policy is a plain callable ``policy(ctx, op, *args, **kwargs) -> Decision``
called once per ATen op of a checkpointed region during the forward pass
(JAX-style: ``jax.checkpoint_policies``). ``SAVE`` keeps the op's outputs
until backward, ``RECOMPUTE`` lets the recompute pass run the op again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RECOMPUTE", "SAVE", "TAG", "Decision", "PolicyContext", "as_decision"]


class Decision(enum.Enum):
    """A policy's answer for one op."""

    SAVE = "save"
    RECOMPUTE = "recompute"

    def __repr__(self) -> str:
        return f"gradckpt.{self.name}"


SAVE = Decision.SAVE
RECOMPUTE = Decision.RECOMPUTE


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
    }


_TORCH_POLICIES = _torch_policy_map()


def as_decision(value: Any, op: Any, policy: Any) -> Decision:
    """Turn a policy's answer into a Decision, or raise a TypeError naming the op.

    Accepts ``SAVE``/``RECOMPUTE``, a bool (True means save, as in JAX and torch)
    and torch's ``CheckpointPolicy`` values, so torch SAC policies work unchanged.
    """
    if value is SAVE or value is RECOMPUTE:
        return value
    if isinstance(value, bool):
        return SAVE if value else RECOMPUTE
    decision = _TORCH_POLICIES.get(value) if not isinstance(value, torch.Tensor) else None
    if decision is not None:
        return decision
    name = getattr(policy, "__name__", repr(policy))
    raise TypeError(
        f"checkpoint policy {name} returned {value!r} for op {op}; a policy must return "
        "gradckpt.SAVE or gradckpt.RECOMPUTE (a bool or torch's CheckpointPolicy also works)"
    )
