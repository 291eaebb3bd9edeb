"""Layer 5 (planning): plans, their simulation, the solvers and the Planner that choose them.

The verb is :func:`gradckpt.plan` (in :mod:`gradckpt.api`); this package is its machinery.
"""

from gradckpt.planning.plan import PLAN_VERSION, Item, Plan, Segment, UnitChoice, iter_units
from gradckpt.planning.simulate import Prediction, simulate

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

