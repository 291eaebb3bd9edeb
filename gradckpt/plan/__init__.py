"""Layer 5: plans, their simulation, and the solvers that choose them."""

from gradckpt.plan.plan import PLAN_VERSION, Item, Plan, Segment, UnitChoice, iter_units
from gradckpt.plan.simulate import Prediction, simulate

__all__ = [
    "PLAN_VERSION",
    "Item",
    "Plan",
    "Prediction",
    "Segment",
    "UnitChoice",
    "iter_units",
    "simulate",
]
