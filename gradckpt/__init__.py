"""gradckpt: gradient (activation) checkpointing for PyTorch that plans itself.

State a memory budget; gradckpt measures the training step, finds the plan with
the least recompute that fits, applies it in place, and proves it.

Example:
    >>> plan = gradckpt.fit(model, lambda: model(batch).loss, budget="12GiB")
    >>> print(plan.summary())
"""

from gradckpt import integrations, measure, planning, policies, profiling
from gradckpt.api import (
    FrontierPoint,
    ProfileOptions,
    ShapeOptions,
    StepOptions,
    explain,
    fit,
    frontier,
    plan,
    profile,
)
from gradckpt.apply import PlanMismatchError, applied_plan, apply, remove
from gradckpt.apply.guard import ShapeError, ShapeStats, shape_stats
from gradckpt.compiled.in_graph import compile
from gradckpt.compiled.watch import compile_stats
from gradckpt.engine import (
    RECOMPUTE,
    SAVE,
    TAG,
    CheckpointError,
    Chunk,
    Decision,
    Keep,
    Offload,
    PolicyContext,
    Recompute,
    RecomputeOffload,
    Selective,
    checkpoint,
    checkpoint_sequential,
    chunked_cross_entropy,
    tag,
)
from gradckpt.planning import Plan, Segment, UnitChoice, simulate
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.errors import PlanFormatError
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.planset import PlanSet
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.profiling import Profile
from gradckpt.tuning import TuneResult, tune

__version__ = "0.1.0"

__all__ = [
    "RECOMPUTE",
    "SAVE",
    "TAG",
    "BudgetError",
    "CheckpointError",
    "Chunk",
    "Decision",
    "FrontierPoint",
    "Keep",
    "Offload",
    "OffloadOptions",
    "Plan",
    "PlanFormatError",
    "PlanMismatchError",
    "PlanSet",
    "Planner",
    "PolicyContext",
    "Profile",
    "ProfileOptions",
    "Recompute",
    "RecomputeOffload",
    "Segment",
    "Selective",
    "ShapeError",
    "ShapeOptions",
    "ShapeStats",
    "StepOptions",
    "TuneResult",
    "UnitChoice",
    "__version__",
    "applied_plan",
    "apply",
    "checkpoint",
    "checkpoint_sequential",
    "chunked_cross_entropy",
    "compile",
    "compile_stats",
    "explain",
    "fit",
    "frontier",
    "integrations",
    "measure",
    "plan",
    "planning",
    "policies",
    "profile",
    "profiling",
    "remove",
    "shape_stats",
    "simulate",
    "tag",
    "tune",
]
