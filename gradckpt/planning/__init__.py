"""Layer 5 (planning): plans, their simulation, the solvers and the Planner that choose them.

The verb is :func:`gradckpt.plan` (in :mod:`gradckpt.api`); this package is its
machinery, in parts that import only the parts before them (lowest first;
``tests/test_layers.py`` holds the order):

* :mod:`.handlers`: the decision-kind registry and the values its hooks exchange;
* :mod:`.plans`: the plan as data (items, file format, summary, plan sets);
* :mod:`.simulation`: a plan's predicted peak and time on a profiled step;
* :mod:`.solving`: the chain model and its DP, the baselines, the solvers;
* :mod:`.kinds`: the decision kinds (keep, recompute, offload, selective), each
  with its planning parts, reached by the parts below only through the registry;
* :mod:`.explaining`: what a plan keeps for backward, and why;
* this package's own modules: :mod:`.solve` (every plan's one door) and
  :mod:`.planner` (``Planner``).
"""

# The built-in kinds register as imported, before anything can ask the registry:
# every planning module is imported through this package.
from gradckpt.planning import kinds  # noqa: F401
from gradckpt.planning.plans.plan import PLAN_VERSION, Item, Plan, Segment, UnitChoice, iter_units
from gradckpt.planning.simulation.simulate import Prediction, simulate

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
