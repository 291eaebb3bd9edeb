"""gradckpt: gradient (activation) checkpointing for PyTorch that plans itself.

State a memory budget; gradckpt measures the training step, finds the plan with
the least recompute that fits, applies it in place, and proves it.

Example:
    >>> plan = gradckpt.fit(model, lambda: model(batch).loss, budget="12GiB")
    >>> print(plan.summary())
"""

from gradckpt import measure, plan, policies, profile
from gradckpt.api import FrontierPoint, fit, frontier
from gradckpt.apply import PlanMismatchError, applied_plan, apply, remove
from gradckpt.apply.guard import ShapeError, ShapeStats, shape_stats
from gradckpt.engine import (
    RECOMPUTE,
    SAVE,
    TAG,
    CheckpointError,
    Decision,
    Keep,
    Offload,
    PolicyContext,
    Recompute,
    Selective,
    checkpoint,
    checkpoint_sequential,
    tag,
)
from gradckpt.integrations.compiled import compile
from gradckpt.plan import Plan, Segment, UnitChoice, simulate
from gradckpt.plan.budget import BudgetError
from gradckpt.plan.errors import PlanFormatError
from gradckpt.plan.explain import explain
from gradckpt.plan.offload_cost import OffloadOptions
from gradckpt.plan.planset import PlanSet
from gradckpt.profile import Profile

__version__ = "0.1.0"

__all__ = [
    "RECOMPUTE",
    "SAVE",
    "TAG",
    "BudgetError",
    "CheckpointError",
    "Decision",
    "FrontierPoint",
    "Keep",
    "Offload",
    "OffloadOptions",
    "Plan",
    "PlanFormatError",
    "PlanMismatchError",
    "PlanSet",
    "PolicyContext",
    "Profile",
    "Recompute",
    "Segment",
    "Selective",
    "ShapeError",
    "ShapeStats",
    "UnitChoice",
    "__version__",
    "applied_plan",
    "apply",
    "checkpoint",
    "checkpoint_sequential",
    "compile",
    "explain",
    "fit",
    "frontier",
    "measure",
    "plan",
    "policies",
    "profile",
    "remove",
    "shape_stats",
    "simulate",
    "tag",
]
