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


def _plan_verb():
    from gradckpt.api import plan

    return plan


from gradckpt._callable import make_callable  # noqa: E402

make_callable(__name__, _plan_verb)
