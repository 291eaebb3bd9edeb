"""The whole training step's peak in parts: what a person reads before renting a GPU.

Plain data on a :class:`~gradckpt.planning.plans.plan.Plan` (``plan.step``), filled
from a profile that counts the training step
(:func:`gradckpt.planning.solving.whole_step.with_training_step`).

Example:
    >>> print("\\n".join(plan.step.lines()))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gradckpt.measure.memory import format_bytes

__all__ = ["StepParts"]


@dataclass(frozen=True)
class StepParts:
    """The parts of a plan's predicted peak and the phase that sets it.

    ``phase`` is "forward/backward", "forward/backward, gradients resident"
    (a micro-batch after the first under accumulation, or gradients never set
    to None) or "optimizer step". ``activations`` is what the plan keeps for
    backward plus recompute and kernel workspace at the peak (0 when the
    optimizer step sets it); ``optimizer_step`` the step's temporaries at the
    peak (0 when forward/backward sets it). ``headroom``: what ``budget="auto"``
    kept back from the device (not part of the peak).
    """

    params: int
    gradients: int
    optimizer_state: int
    optimizer_step: int
    activations: int
    phase: str
    optimizer: str = ""  # "" : the optimizer is not counted
    accumulation_steps: int = 1
    set_to_none: bool = True
    headroom: int = 0
    #: How ``budget="auto"`` read the device ("" for a budget given in bytes).
    budget_rule: str = ""

    @property
    def total(self) -> int:
        """The predicted whole-step peak (the parts summed; headroom excluded)."""
        return (
            self.params + self.gradients + self.optimizer_state + self.optimizer_step
            + self.activations
        )  # fmt: skip

    def lines(self) -> list[str]:
        """The breakdown, one part per line, and what is not counted."""
        rows = [
            ("parameters and buffers", self.params),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("optimizer step temporaries", self.optimizer_step),
            ("activations, recompute, workspace", self.activations),
        ]
        out = [f"  whole-step peak {format_bytes(self.total)}, set by the {self.phase}:"]
        out += [f"    {name:<36} {format_bytes(n):>12}" for name, n in rows]
        if self.budget_rule:
            out.append(f"  budget from the device: {self.budget_rule}")
        if not self.optimizer:
            out.append(
                "  the optimizer is NOT counted (pass optimizer= to count its state and step)"
            )
        else:
            grads = "set to None" if self.set_to_none else "zeroed in place (resident)"
            out.append(
                f"  counted: {self.optimizer}; {self.accumulation_steps} micro-batch(es) per "
                f"step; gradients {grads}"
            )
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepParts:
        return cls(**data)
