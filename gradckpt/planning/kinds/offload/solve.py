"""Plan with offload: keep, recompute or offload per block, under a device and a host budget.

The chain DP (:mod:`gradckpt.planning.solving.dp`) chooses among each block's options,
offload among them (:func:`gradckpt.planning.solving.chain.build_chain` with options), so
the three decisions are made jointly under the device budget. The host budget
is a second resource the DP's one memory axis does not hold; it is priced
instead (a Lagrangian): each offloaded byte costs ``price`` seconds, raised
until the plan's host bytes fit. The result is then compared with the plan
made without offload, and the faster of those that fit is returned, so offload
never makes a plan slower than the DP's own.

Example:
    >>> plan = solve_offload(prof, 600 << 20, OffloadOptions(host_budget=2 << 30))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from gradckpt.engine.decisions import Offload, RecomputeOffload
from gradckpt.planning.kinds.offload.boundary import offloadable_boundary
from gradckpt.planning.kinds.offload.floor import least_peak_offload, offload_budget_error
from gradckpt.planning.kinds.offload.sim import moved_storages
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.simulation.simulate import Prediction, simulate
from gradckpt.planning.solving.baselines import finish
from gradckpt.planning.solving.brute import evaluate
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.chain import ChainModel, build_chain, with_engine_costs
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.dp_chain import Chain, Tree, UnitStep
from gradckpt.planning.solving.solvers import solve_dp
from gradckpt.profiling.records import Profile

__all__ = [
    "host_bytes_of",
    "offload_candidates",
    "priced_chain",
    "solve_chain_priced",
    "solve_offload",
]

_DOUBLINGS = 24
_BISECTIONS = 12


def priced_chain(chain: Chain, host: Sequence[Sequence[int]], price: float) -> Chain:
    """``chain`` with about ``price`` seconds added per host byte of each option (``host[stage][k]``).

    Example:
        >>> priced_chain(chain, [[0, 0, 4096]], 1e-9).stages[0].options[2].time
    """
    if price == 0:
        return chain
    stages = []
    n = len(chain.stages)
    for i, (st, row) in enumerate(zip(chain.stages, host)):
        # Identical blocks would all switch at one price (a duality gap: none or all
        # offloaded); a slightly higher price further down the chain makes them switch
        # one at a time, so bisection can stop where the host budget is just met.
        each = price * (1 + i / (4 * n))
        options = tuple(replace(o, time=o.time + each * h) for o, h in zip(st.options, row))
        stages.append(replace(st, options=options))
    return replace(chain, stages=tuple(stages))


def host_bytes_of(tree: Tree, host: Sequence[Sequence[int]]) -> int:
    """Host bytes a schedule holds: its top-level units' options (segments run nothing offloaded).

    Example:
        >>> host_bytes_of([UnitStep(0, 2), UnitStep(1, 0)], [[0, 0, 4096], [0, 0, 4096]])
        4096
    """
    return sum(host[node.stage][node.option] for node in tree if isinstance(node, UnitStep))


def _prices(scale: float):
    """0, then ``scale`` doubled until the host budget holds."""
    yield 0.0
    for k in range(_DOUBLINGS):
        yield scale * 2.0**k


def solve_chain_priced(
    chain: Chain, host: Sequence[Sequence[int]], m: int, host_budget: int | None
) -> tuple[Tree, float] | None:
    """The DP's schedule within ``m`` units whose host bytes fit ``host_budget``, by pricing.

    Returns (schedule, its unpriced time), or None when nothing fits. Exact when
    the host budget does not bind; otherwise the least price that makes it hold,
    refined by bisection (a Lagrangian: feasible, not always optimal).

    Example:
        >>> tree, seconds = solve_chain_priced(chain, host, 100, host_budget=1 << 20)
    """
    total_time = sum(max(o.time for o in st.options) for st in chain.stages) or 1.0
    total_host = sum(max(h) for h in host) or 1
    scale = total_time / total_host

    def attempt(price: float) -> tuple[Tree, float, int] | None:
        dp = ChainDP(priced_chain(chain, host, price))
        if not math.isfinite(dp.best_time(m)):
            return None
        tree = dp.schedule(m)
        _, seconds = evaluate(chain, tree)
        return tree, seconds, host_bytes_of(tree, host)

    low, best = 0.0, None
    for price in _prices(scale):
        found = attempt(price)
        if found is None:
            return None
        if host_budget is None or found[2] <= host_budget:
            best, high = found, price
            break
        low = price
    if best is None:
        return None
    for _ in range(_BISECTIONS if high > 0 else 0):
        mid = (low + high) / 2
        found = attempt(mid)
        if found is not None and found[2] <= host_budget:  # type: ignore[operator]
            high = mid
            if found[1] < best[1]:
                best = found
        else:
            low = mid
    return best[0], best[1]


def _host_table(model: ChainModel, profile: Profile) -> list[list[int]]:
    """Host bytes of each stage's each option: what an ``Offload`` option moves, what a
    ``RecomputeOffload`` option moves (its kept input), else 0."""
    min_bytes = (model.offload or OffloadOptions()).min_bytes
    table = []
    for unit, opts in zip(model.units, model.options):
        moved = sum(profile.storages[s].nbytes for s in moved_storages(profile, unit, min_bytes))
        sid = offloadable_boundary(profile, unit, min_bytes)
        boundary = profile.storages[sid].nbytes if sid is not None else 0
        table.append([
            moved if isinstance(o, Offload) else boundary if isinstance(o, RecomputeOffload) else 0
            for o in opts
        ])  # fmt: skip
    return table


def _priced_model(model: ChainModel, host: list[list[int]], price: float) -> ChainModel:
    return replace(model, chain=priced_chain(model.chain, host, price))


def solve_offload(
    profile: Profile, budget: int, options: OffloadOptions, *, segments: bool = True,
    model: ChainModel | None = None, floor: tuple[Plan, Prediction] | None = None,
) -> Plan:  # fmt: skip
    """The fastest plan within ``budget`` device bytes and ``options.host_budget`` host bytes.

    Besides the DP's plans with and without offload, the DP's plan with its offloaded
    blocks streamed and the leanest plan with offload (``floor``, from
    :func:`least_peak_offload` when not given) are weighed wherever they fit: the
    DP's memory model groups offloaded tensors, so it cannot find streamed plans
    itself. Raises :class:`BudgetError` when no plan fits the device budget.

    Example:
        >>> plan = solve_offload(prof, 600 << 20, OffloadOptions())
    """
    candidates: list[Plan] = []
    error: BudgetError | None = None
    try:
        candidates.append(solve_dp(profile, budget, segments=segments))
    except BudgetError as e:
        error = e
    model = model or with_engine_costs(build_chain(profile, settings={Offload: options}), profile)
    host = _host_table(model, profile)
    limit = options.host_budget
    scale = profile.step_time / max(1, sum(max(h) for h in host))

    def attempt(price: float) -> Plan | None:
        try:
            plan = solve_dp(profile, budget, model=_priced_model(model, host, price), segments=segments)
        except BudgetError:
            return None
        return plan

    low, high, found = 0.0, None, None
    for price in _prices(scale):
        plan = attempt(price)
        if plan is None:
            break
        if limit is None or simulate(profile, plan).host_bytes <= limit:
            found, high = plan, price
            break
        low = price
    if found is not None and high:
        for _ in range(_BISECTIONS):
            mid = (low + high) / 2
            plan = attempt(mid)
            if plan is not None and simulate(profile, plan).host_bytes <= limit:  # type: ignore[operator]
                high = mid
                if plan.predicted_step_time < found.predicted_step_time:
                    found = plan
            else:
                low = mid
    least, pred = floor or least_peak_offload(profile, options, model=model, segments=segments)
    if found is None and error is not None and pred.peak_bytes > budget:
        raise offload_budget_error(error, pred, options)
    if pred.peak_bytes <= budget:
        # Below the floor without offload the DP's model may miss by a little, and it
        # never streams: the leanest plan with offload (repaired on the simulator) may
        # fit where the DP's does not, or be faster.
        candidates.append(finish(profile, least, budget, "dp", pred)[0])
    if found is not None:
        candidates.append(found)
        if not options.stream and any(isinstance(i.decision, Offload) for i in found.units):
            streamed = replace(found, offload=replace(options, stream=True))
            plan, at = finish(profile, streamed, budget, "dp")
            if at.peak_bytes <= budget and (limit is None or at.host_bytes <= limit):
                candidates.append(plan)
    if not candidates:
        assert error is not None
        raise error
    best = min(candidates, key=lambda p: p.predicted_step_time)
    # The leanest plan may stream offloaded blocks (the floor's search tries both modes).
    streamed = best.offload is not None and best.offload.stream
    return replace(best, offload=replace(options, stream=True) if streamed else options)


def offload_candidates(
    profile: Profile, options: OffloadOptions, budgets: Sequence[int], *, most: int = 12
) -> list[Plan]:
    """Plans made with offload at up to ``most`` of ``budgets`` (spread evenly), for a frontier,
    and, below the least of them, the leanest plan with offload and two budgets between.

    Example:
        >>> offload_candidates(prof, OffloadOptions(), [400 << 20, 600 << 20])
    """
    budgets = sorted(set(budgets))
    if len(budgets) > most:
        budgets = [budgets[round(i * (len(budgets) - 1) / (most - 1))] for i in range(most)]
    model = with_engine_costs(build_chain(profile, settings={Offload: options}), profile)
    least = least_peak_offload(profile, options, model=model)
    floor, pred = least
    plans = [floor]
    if budgets and pred.peak_bytes < budgets[0]:
        # Offload reaches below the curve without it: its frontier goes on there.
        gap = budgets[0] - pred.peak_bytes
        budgets = [pred.peak_bytes + gap // 3, pred.peak_bytes + 2 * gap // 3, *budgets]
    for budget in budgets:
        try:
            plans.append(solve_offload(profile, budget, options, model=model, floor=least))
        except BudgetError:
            continue
    return plans
