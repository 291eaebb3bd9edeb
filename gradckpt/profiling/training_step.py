"""How the training step runs around its forward and backward: what the budget must also hold.

A user's memory is their device, and a training step is phases (DESIGN.md):
micro-batches 1..K forward and backward, then ``optimizer.step()``. Besides
the parameters, the device holds

* the optimizer's state, from the first ``optimizer.step()`` on (AdamW: two
  tensors per parameter), and the temporaries of the step itself;
* the gradients: made during backward when they were set to None, but resident
  from the start of every micro-batch after the first under gradient
  accumulation, and always under ``zero_grad(set_to_none=False)``.

A :class:`TrainingStep` says which; :func:`gradckpt.planning.solving.whole_step.with_training_step`
folds it into a profile, so every plan is simulated, solved and checked for the whole step.

Example:
    >>> step = TrainingStep(optimizer_memory(model, "adamw"), accumulation_steps=4)
    >>> step.grads_resident
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradckpt.measure.optimizer import OptimizerMemory

__all__ = ["TrainingStep"]


@dataclass(frozen=True)
class TrainingStep:
    """The optimizer's memory, the accumulation steps and how gradients are cleared.

    Args:
        optimizer: the optimizer's predicted memory (None: not counted).
        accumulation_steps: micro-batches per optimizer step (gradients resident
            from the second one on).
        set_to_none: gradients cleared with ``zero_grad(set_to_none=True)`` (torch's
            default); False keeps them resident through every forward.

    Example:
        >>> TrainingStep(None, accumulation_steps=2).grads_resident
        True
    """

    optimizer: OptimizerMemory | None = None
    accumulation_steps: int = 1
    set_to_none: bool = True

    def __post_init__(self) -> None:
        k = self.accumulation_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"accumulation_steps is a whole number of micro-batches per optimizer step "
                f"(1: no accumulation), got {k!r}"
            )
        if not isinstance(self.set_to_none, bool):
            raise TypeError(f"set_to_none is True or False, got {self.set_to_none!r}")

    @property
    def grads_resident(self) -> bool:
        """Whether gradients are held from the start of some micro-batch's forward."""
        return self.accumulation_steps > 1 or not self.set_to_none

    @property
    def state_bytes(self) -> int:
        """Optimizer state resident through every forward and backward (0: not counted)."""
        return self.optimizer.state_bytes if self.optimizer is not None else 0

    def describe(self) -> str:
        """One line: optimizer, accumulation, how gradients are cleared."""
        opt = self.optimizer.name if self.optimizer is not None else "optimizer not counted"
        acc = f"{self.accumulation_steps} micro-batches per step"
        grads = (
            "zero_grad(set_to_none=True)" if self.set_to_none else "zero_grad(set_to_none=False)"
        )
        return f"{opt}; {acc}; {grads}"

    def to_json(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.to_json() if self.optimizer is not None else None,
            "accumulation_steps": self.accumulation_steps,
            "set_to_none": self.set_to_none,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainingStep:
        opt = data.get("optimizer")
        return cls(
            OptimizerMemory.from_json(opt) if opt is not None else None,
            int(data.get("accumulation_steps", 1)),
            bool(data.get("set_to_none", True)),
        )
