"""``solve``: the one door every solver's plan leaves through.

Built-in solvers by name (:data:`~gradckpt.planning.solving.solvers.SOLVERS`),
a user's solver callable, or the DP with an offload link (the offload kind's
own solver, :mod:`gradckpt.planning.kinds.offload.solve`): whichever made the
plan, its predictions come from the simulator and its peak is checked against
the budget here. It sits above the decision kinds, since one kind brings its
own solver; :class:`~gradckpt.planning.planner.Planner` and the API plan
through it.
"""

from __future__ import annotations

from gradckpt.measure.memory import format_bytes
from gradckpt.planning.kinds.offload.solve import solve_offload
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan, Segment
from gradckpt.planning.solving.baselines import finish
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.chain import ChainModel
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.solvers import SOLVERS, Solver, check_plannable, solve_dp
from gradckpt.profiling.records import Profile

__all__ = ["solve"]


def solve(
    profile: Profile,
    budget: int,
    solver: str | Solver = "dp",
    *,
    segments: bool = True,
    model: ChainModel | None = None,
    dp: ChainDP | None = None,
    offload: OffloadOptions | None = None,
) -> Plan:
    """Run a solver by name (see ``SOLVERS``) or a solver callable.

    Every solver's plan, built-in or custom, leaves through the same door: its
    predictions come from the simulator (a custom solver's claims are not
    trusted) and its predicted peak is checked against ``budget``.
    ``segments=False`` forbids multi-unit regions: the DP does not make them,
    and a baseline that does (``sqrt``) is refused. ``model`` and ``dp``: the
    DP's chain and tables already built (:class:`gradckpt.planning.planner.Planner`).
    ``offload``: the DP may also offload blocks over that link
    (:mod:`gradckpt.planning.kinds.offload.solve`).

    Example:
        >>> solve(prof, 600 << 20, "sqrt").solver
        'sqrt'
    """
    check_plannable(profile)
    if callable(solver):
        name = getattr(solver, "__name__", "custom")
        chosen = solver(profile, budget)
        if not isinstance(chosen, Plan):
            raise TypeError(
                f"the {name} solver returned {type(chosen).__name__}, not a gradckpt Plan; "
                "a solver takes (profile, budget_bytes) and returns a Plan"
            )
        chosen = finish(profile, chosen, budget, name)[0]  # whatever it claimed is replaced
    elif solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    elif solver == "dp" and offload is not None:
        chosen = solve_offload(profile, budget, offload, segments=segments)
    elif solver == "dp":
        chosen = solve_dp(profile, budget, model=model, dp=dp, segments=segments)
    else:
        chosen = SOLVERS[solver](profile, budget)
    name = solver if isinstance(solver, str) else chosen.solver
    if chosen.predicted_peak_bytes > budget:
        raise BudgetError(
            f"the {name} scheme peaks at {format_bytes(chosen.predicted_peak_bytes)}, over the "
            f"budget of {format_bytes(budget)}",
            least_peak_bytes=chosen.predicted_peak_bytes,
        )
    if not segments and any(isinstance(item, Segment) for item in chosen.items):
        raise ValueError(
            f"the {name} solver made a plan with segments, which segments=False forbids "
            "(segments cannot run under FSDP); use solver='dp' or a per-block baseline"
        )
    return chosen
