"""``Planner``: one profile's chain and dynamic program, built once, asked many questions.

Every planning question about one profile (the plan for a budget, the least
reachable peak, the memory-time frontier, an explanation) reads the same chain
model and DP tables. They take most of the planning time, so the API, the CLI,
the benchmarks and the distributed integration all hold one ``Planner`` per
profile instead of rebuilding them per question; both are built on first use.

Example:
    >>> planner = Planner(gradckpt.profile(model, loss_fn))
    >>> plan = planner.plan("3GiB")
    >>> least_plan, least_pred = planner.least_peak()
    >>> [(p.peak_bytes, p.overhead) for p in planner.frontier(points=8)]
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, replace
from functools import cached_property

from gradckpt.engine.decisions import Chunk
from gradckpt.planning.explaining.explain import Explanation, explain
from gradckpt.planning.kinds.chunk.handler import allow_chunking
from gradckpt.planning.kinds.chunk.token_plan import (
    token_chunked_fit,
    token_chunked_least,
    token_chunked_plans,
)
from gradckpt.planning.kinds.offload.floor import least_peak_offload
from gradckpt.planning.kinds.offload.solve import offload_candidates
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.simulation.simulate import Prediction, simulate
from gradckpt.planning.solve import solve
from gradckpt.planning.solving.budget import Budget, BudgetError
from gradckpt.planning.solving.chain import ChainModel, build_chain, with_engine_costs
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.solvers import (
    Solver,
    check_plannable,
    dp_scan,
    dp_search,
    finish,
    least_peak_plan,
    none_plan,
    schedule_plan,
    without_segments,
)
from gradckpt.planning.solving.whole_step import check_floor
from gradckpt.profiling.records import Profile

__all__ = ["FrontierPoint", "Planner"]

#: Times :meth:`Planner.least_peak` asks the DP for a plan just below the least peak found.
_TIGHTEN = 3
#: Plans of the DP, spread over its memory range, that :meth:`Planner.plan` tries with MLPs
#: chunked when no plan without fits the budget.
_TOKEN_BASES = 6
#: Shares of the way from the least peak without MLP chunking to the plain one where
#: :meth:`Planner.plan` also takes the DP's plan as a base for chunking a few MLPs.
_TOKEN_NEAR_FLOOR = (0.0, 0.01, 0.02, 0.05, 0.1)


@dataclass(frozen=True)
class FrontierPoint:
    """One Pareto-optimal plan: its predicted peak and overhead."""

    peak_bytes: int
    overhead: float
    plan: Plan


class Planner:
    """Plans for one profile; the chain and the DP are built once, on first use.

    Args:
        profile: the measured (or fake) step, from :func:`gradckpt.profile`.
        segments: allow regions spanning several units (False for FSDP: its
            units' parameters are sharded when a segment would recompute them).
        chunking: let the LM head and its loss run in slices of tokens where that
            pays (:class:`~gradckpt.engine.decisions.Chunk`); False keeps every plan
            to keep, recompute, selective and offload, exact bit for bit.

    Example:
        >>> planner = Planner(prof, segments=False)
        >>> planner.plan(0.5, solver="every_kth").solver
        'every_kth(k=2)'
    """

    def __init__(
        self, profile: Profile, *, segments: bool = True, offload: OffloadOptions | None = None,
        chunking: bool = True,
    ) -> None:  # fmt: skip
        if not isinstance(profile, Profile):
            raise TypeError(
                "Planner takes a Profile made by gradckpt.profile(model, loss_fn), got "
                f"{type(profile).__name__}"
            )
        self.profile = profile
        self.segments = segments
        self.offload = offload  # the DP may also move blocks' saved tensors over this link
        self.chunking = chunking  # the DP may also chunk the head and its loss
        self._least: tuple[Plan, Prediction] | None = None
        self._least_unchunked: tuple[Plan, Prediction] | None = None

    @cached_property
    def chain(self) -> ChainModel:
        """The chain model of the profile (engine costs included), built on first use."""
        with allow_chunking(self.chunking):
            model = with_engine_costs(build_chain(self.profile), self.profile)
        return model if self.segments else without_segments(model)

    @cached_property
    def dp(self) -> ChainDP:
        """The dynamic program over :attr:`chain`, built on first use."""
        return ChainDP(self.chain.chain)

    def release(self) -> None:
        """Drop the chain and the DP tables (rebuilt on next use).

        The DP's tables are CPU tensors: on a CPU step they share the memory the
        budget is about, so they are let go before real steps run.

        Example:
            >>> planner.release()
        """
        self.__dict__.pop("chain", None)
        self.__dict__.pop("dp", None)
        # Planning leaves reference cycles that hold DP tables (CPU tensors); without a
        # collection they would still be held while the steps after it run.
        gc.collect()

    def budget_bytes(self, budget: int | float | str | Budget) -> int:
        """``budget`` (bytes, a string with units, a fraction of the plain peak, or a
        :class:`~gradckpt.planning.solving.budget.Budget` read already) in bytes."""
        return Budget.read(budget).bytes_for(self.profile.measured_peak_bytes)

    def plan(
        self, budget: int | float | str | Budget, solver: str | Solver = "dp", *,
        offload: OffloadOptions | None = None,
    ) -> Plan:  # fmt: skip
        """The plan ``solver`` makes for ``budget``, predicted and checked against it.

        ``offload``: instead of the planner's own link (``Planner(offload=...)``);
        with a link the DP builds its own chain with the offload option.

        Raises:
            BudgetError: no plan of that solver fits (with the least peak reachable).

        Example:
            >>> planner.plan("800MB").predicted_peak_bytes <= 800_000_000
            True
        """
        nbytes = self.budget_bytes(budget)
        check_plannable(self.profile)  # before the chain is built: the error in the user's terms
        check_floor(self.profile, nbytes)  # the optimizer's part, which no plan lowers
        with allow_chunking(self.chunking):
            return self._plan(nbytes, solver, offload)

    def _plan(self, nbytes: int, solver: str | Solver, offload: OffloadOptions | None) -> Plan:
        offload = offload if offload is not None else self.offload
        if offload is not None:
            return solve(self.profile, nbytes, solver, segments=self.segments, offload=offload)
        if solver == "dp":
            try:
                return solve(self.profile, nbytes, "dp", segments=self.segments,
                             model=self.chain, dp=self.dp)  # fmt: skip
            except BudgetError as e:
                chunked = self._token_chunked(nbytes) if self.chunking else None
                if chunked is None:
                    raise
                e.__traceback__ = None
                return chunked
        return solve(self.profile, nbytes, solver, segments=self.segments)

    def _token_chunked(self, nbytes: int) -> Plan | None:
        """The fastest plan for ``nbytes`` that runs blocks' MLPs in slices, when no plan
        without that fits (:mod:`gradckpt.planning.kinds.chunk.token_plan`); None: none."""
        if not token_chunked_plans(self.profile, [none_plan(self.profile)]):
            return None  # no token-wise MLP in this step
        floor_plan, floor = self._unchunked_least()
        # The leanest plan's own base (it without its slices) too: every budget at or
        # above the least peak this planner reports is then met, as its docstring says;
        # the DP's bases alone may miss it (a Llama whose leanest chunks the MLPs of
        # every-block recompute, which no DP schedule is).
        bases = [floor_plan, replace(self.least_peak()[0], token_chunks=())]
        # The DP's own plans just above the floor: a few chunked MLPs take off what their
        # hidden activations hold (a few MiB each), so those are the plans they bring down.
        spread = max(0, self.profile.measured_peak_bytes - floor.peak_bytes)
        for share in _TOKEN_NEAR_FLOOR:
            near = floor.peak_bytes + round(share * spread)
            with contextlib.suppress(BudgetError):
                bases.append(solve(self.profile, near, "dp", segments=self.segments,
                                   model=self.chain, dp=self.dp))  # fmt: skip
        least = self.dp.least_feasible()
        if least is not None:
            top = self.chain.chain.capacity
            for i in range(_TOKEN_BASES):
                m = least + round(i * (top - least) / (_TOKEN_BASES - 1))
                bases.append(schedule_plan(self.profile, self.chain, self.dp, m))
        bases = list({plan.items: plan for plan in bases if not plan.token_chunks}.values())
        return token_chunked_fit(self.profile, nbytes, bases)

    def least_peak(self) -> tuple[Plan, Prediction]:
        """The leanest plan reachable and its prediction (``.peak_bytes``: the least peak);
        with offload, over the planner's link (:func:`least_peak_offload`).

        Example:
            >>> plan, pred = planner.least_peak()
        """
        if self._least is None:
            with allow_chunking(self.chunking):
                self._least = self._least_peak()
        return self._least

    def _least_peak(self) -> tuple[Plan, Prediction]:
        found = self._unchunked_least()
        return token_chunked_least(self.profile, found) if self.chunking else found

    def _unchunked_least(self) -> tuple[Plan, Prediction]:
        """The leanest plan without MLPs in slices (the head may be chunked)."""
        if self._least_unchunked is None:
            if self.offload is not None:
                found = least_peak_offload(self.profile, self.offload, segments=self.segments)
            else:
                found = least_peak_plan(self.profile, segments=self.segments)
            self._least_unchunked = self._tightened(found) if self._chunks_offered() else found
        return self._least_unchunked

    def _chunks_offered(self) -> bool:
        return self.chunking and any(
            isinstance(o, Chunk) for options in self.chain.options for o in options
        )

    def _tightened(self, found: tuple[Plan, Prediction]) -> tuple[Plan, Prediction]:
        """``found``, or the plan :meth:`plan` makes just below its peak when it reaches lower.

        With a chunked head the least peak is set by blocks' regions, where plans differ
        by a region's few kilobytes (its RNG state); the least-peak search runs on times
        estimated from FLOPs, :meth:`plan` on measured ones, and either may find the
        other's last bytes. No budget :meth:`plan` meets stays below what this returns.
        """
        model, dp = self.chain, self.dp
        for _ in range(_TIGHTEN):
            budget = found[1].peak_bytes - 1
            lower = dp_search(self.profile, budget, model, dp, self.segments)
            lower = lower or dp_scan(self.profile, budget, model, dp, self.segments)
            if lower is None:
                break
            found = (lower, simulate(self.profile, lower))
        return found

    def frontier(self, points: int = 32) -> list[FrontierPoint]:
        """The memory-time Pareto curve, from the least feasible peak to the plain step.

        ``points`` budgets are spread evenly over the DP's memory range; plans
        that come out the same, or are beaten on both peak and time, are dropped.

        Example:
            >>> [f"{p.overhead:+.1%}" for p in planner.frontier(points=4)]
        """
        with allow_chunking(self.chunking):
            return self._frontier(points)

    def _frontier(self, points: int) -> list[FrontierPoint]:
        prof = self.profile
        least = self.dp.least_feasible()
        candidates = [none_plan(prof)]
        if least is not None:
            top = self.chain.chain.capacity
            steps = max(2, points)
            for i in range(steps):
                m = least + round(i * (top - least) / (steps - 1))
                candidates.append(schedule_plan(prof, self.chain, self.dp, m))
        seen: dict[tuple, FrontierPoint] = {}
        for candidate in candidates:
            if candidate.items in seen:
                continue
            done, pred = finish(prof, candidate, None, "dp")
            seen[candidate.items] = FrontierPoint(pred.peak_bytes, pred.overhead, done)
        if self.offload is not None:
            budgets = sorted({point.peak_bytes for point in seen.values()})
            for candidate in offload_candidates(prof, self.offload, budgets):
                if candidate.items not in seen:
                    done, pred = finish(prof, candidate, None, "dp")
                    seen[candidate.items] = FrontierPoint(pred.peak_bytes, pred.overhead, done)
        pareto: list[FrontierPoint] = []
        for point in sorted(seen.values(), key=lambda p: (p.peak_bytes, p.overhead)):
            if not pareto or point.overhead < pareto[-1].overhead:
                pareto.append(point)
        return pareto

    def explain(
        self, budget: int | float | str | Budget | None = None, plan: Plan | None = None
    ) -> Explanation:
        """What the step keeps for backward under ``plan``, or the plan for ``budget``,
        or (neither) the plain step; see :mod:`gradckpt.planning.explaining.explain`.

        Example:
            >>> print(planner.explain("2GiB").table())
        """
        if plan is None and budget is not None:
            plan = self.plan(budget)
        with allow_chunking(self.chunking):
            return explain(self.profile, plan)
