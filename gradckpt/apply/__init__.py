"""Layer 6: install a plan on a live model (and take it off again)."""

from gradckpt.apply.apply import PlanMismatchError, applied_plan, apply, remove

__all__ = ["PlanMismatchError", "applied_plan", "apply", "remove"]
