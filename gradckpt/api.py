"""The verbs users call: ``plan``, ``fit``, ``frontier`` (``apply``/``remove`` live in apply/)."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradckpt import integrations
from gradckpt.apply.apply import apply
from gradckpt.plan.budget import check_budget, parse_budget
from gradckpt.plan.chain import build_chain
from gradckpt.plan.costs import with_engine_costs
from gradckpt.plan.dp import ChainDP
from gradckpt.plan.plan import Plan
from gradckpt.plan.solvers import SOLVERS, Solver, _items, finish, none_plan, solve
from gradckpt.profile.records import Profile
from gradckpt.profile.run import profile as profile_step
from gradckpt.profile.units import BlockSpec

__all__ = ["FrontierPoint", "fit", "frontier", "plan", "profile"]

LossFn = Callable[[], torch.Tensor]


_UNSET: Any = object()


def _check_arguments(
    model: object,
    loss_fn: object,
    budget: object = _UNSET,
    *,
    blocks: object = None,
    solver: object = "dp",
    repeats: object = 3,
    profile: object = None,
    segments: object = True,
) -> None:
    """Refuse bad arguments in the user's terms, before anything is profiled."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(
            "loss_fn must be a zero-argument callable that runs one forward and returns the "
            f"loss (e.g. lambda: model(**batch).loss), got {type(loss_fn).__name__}"
        )
    if budget is not _UNSET:
        check_budget(budget)
    if blocks is not None and not callable(blocks):
        listed = isinstance(blocks, Collection) and not isinstance(blocks, str)
        if not listed or not all(isinstance(p, str) for p in blocks):
            raise TypeError(
                "blocks= takes a list of module paths (e.g. ['layers.0', 'layers.1'], from "
                f"model.named_modules()) or a predicate (path, module) -> bool; got {blocks!r}"
            )
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral):
        raise TypeError(f"repeats= is a whole number of profiled steps (e.g. 3), got {repeats!r}")
    if repeats < 1:
        raise ValueError(f"repeats= must be at least 1 (profiled steps), got {repeats}")
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(
            "profile= takes a Profile made by gradckpt.profile(model, loss_fn), got "
            f"{type(profile).__name__}"
        )
    if isinstance(solver, str):
        if solver not in SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    elif not callable(solver):
        raise TypeError(f"solver= is a name from {sorted(SOLVERS)} or a callable, got {solver!r}")
    if not isinstance(segments, bool):
        raise TypeError(f"segments= is True or False, got {segments!r}")


def profile(model: nn.Module, loss_fn: LossFn, **options: Any) -> Profile:
    """Measure one training step (``gradckpt.profile``); see :func:`gradckpt.profile.profile`.

    Integrations prepare the model first (transformers: no KV cache while profiling).

    Example:
        >>> prof = gradckpt.profile(model, loss_fn, fake=True)
    """
    _check_arguments(
        model, loss_fn, blocks=options.get("blocks"), repeats=options.get("repeats", 3)
    )
    with integrations.preparing(model, fake=bool(options.get("fake"))):
        return profile_step(model, loss_fn, **options)


def _profile(
    model: nn.Module, loss_fn: LossFn, blocks: BlockSpec, repeats: int, given: Profile | None
) -> Profile:
    if given is not None:
        return given
    return profile(model, loss_fn, blocks=blocks, repeats=repeats)


def plan(
    model: nn.Module,
    loss_fn: LossFn,
    budget: int | float | str,
    *,
    blocks: BlockSpec = None,
    solver: str | Solver = "dp",
    repeats: int = 3,
    profile: Profile | None = None,
    segments: bool = True,
) -> Plan:
    """The least-recompute checkpointing plan whose peak fits ``budget``; the model is untouched.

    Args:
        model: the model to plan for.
        loss_fn: zero-argument callable: one forward on a representative batch, returns the loss.
            Called ``1 + 2 * repeats`` times while profiling (see :func:`gradckpt.profile`);
            everything it touches is left as found.
        budget: bytes (int), a string with units ("800MB", "1.5GiB"), or a float in
            (0, 1] meaning that fraction of the uncheckpointed peak.
        blocks: the repeated blocks (paths or predicate); found automatically if None.
        solver: "dp" (default) or a baseline name from ``gradckpt.plan.solvers.SOLVERS``.
        repeats: profiled steps to take median op times from.
        profile: a profile from ``gradckpt.profile(...)`` to reuse instead of measuring.
        segments: allow regions that span several units (False for FSDP, whose
            units' parameters are sharded when a segment would recompute them).

    Returns:
        A :class:`Plan` with its predicted peak and overhead.

    Raises:
        BudgetError: no plan fits; the message gives the least reachable peak.

    Example:
        >>> p = gradckpt.plan(model, lambda: model(x).loss, budget="3GiB")
        >>> print(p.summary())
    """
    _check_arguments(model, loss_fn, budget, blocks=blocks, solver=solver, repeats=repeats,
                     profile=profile, segments=segments)  # fmt: skip
    prof = _profile(model, loss_fn, blocks, repeats, profile)
    return solve(prof, parse_budget(budget, prof.measured_peak_bytes), solver, segments=segments)


def fit(
    model: nn.Module,
    loss_fn: LossFn,
    budget: int | float | str,
    *,
    measure_candidates: int = 2,
    **options: object,
) -> Plan:
    """:func:`plan` and :func:`gradckpt.apply` in one call; returns the applied plan.

    ``measure_candidates``: how many plans that fit (the planner's, then the next
    fastest predicted) to run for 3 real steps each, interleaved with the plain
    step, keeping the fastest measured (:mod:`gradckpt.apply.select`). It costs
    ``3 * (measure_candidates + 1)`` training steps: 9 by default, about what
    profiling costs. The plan records ``measured_overhead`` next to
    ``predicted_overhead``. 0 turns it off; fake profiles are never measured.

    Example:
        >>> plan = gradckpt.fit(model, loss_fn, budget=0.5)
        >>> plan.predicted_overhead, plan.measured_overhead
        >>> gradckpt.fit(model, loss_fn, budget=0.5, compile={"backend": "inductor"})
    """
    from gradckpt.apply.select import fastest_measured

    compiled = options.pop("compile", False)  # True or torch.compile kwargs: the plan compiled
    if compiled:
        options.setdefault("segments", False)  # the compiler checkpoints one call per region
    _check_arguments(model, loss_fn, budget, **options)  # before the model is touched
    if (
        isinstance(measure_candidates, bool)
        or not isinstance(measure_candidates, int)
        or measure_candidates < 0
    ):
        raise ValueError(
            f"gradckpt: measure_candidates must be a whole number >= 0 (0 turns the "
            f"measurement off), got {measure_candidates!r}"
        )
    with integrations.training(model):  # transformers: use_cache off for training, said once
        given = options.pop("profile", None)
        prof = _profile(model, loss_fn, options.get("blocks"), options.get("repeats", 3), given)  # type: ignore[arg-type]
        chosen = plan(model, loss_fn, budget, profile=prof, **options)  # type: ignore[arg-type]
        if measure_candidates and not prof.fake:
            segments = bool(options.get("segments", True))
            count = measure_candidates if options.get("solver", "dp") == "dp" else 1
            chosen = fastest_measured(model, loss_fn, prof, chosen, count, segments=segments)
        apply(model, chosen)
    if compiled:
        from gradckpt.integrations.compiled import compile as compile_planned

        compile_planned(model, loss_fn, **(compiled if isinstance(compiled, dict) else {}))
    return chosen


@dataclass(frozen=True)
class FrontierPoint:
    """One Pareto-optimal plan: its predicted peak and overhead."""

    peak_bytes: int
    overhead: float
    plan: Plan


def frontier(
    model: nn.Module,
    loss_fn: LossFn,
    *,
    points: int = 32,
    blocks: BlockSpec = None,
    repeats: int = 3,
    profile: Profile | None = None,
) -> list[FrontierPoint]:
    """The memory-time Pareto curve, from the least feasible peak to the plain step.

    Example:
        >>> for point in gradckpt.frontier(model, loss_fn):
        ...     print(point.peak_bytes, f"{point.overhead:+.1%}")
    """
    _check_arguments(model, loss_fn, blocks=blocks, repeats=repeats, profile=profile)
    prof = _profile(model, loss_fn, blocks, repeats, profile)
    chain = with_engine_costs(build_chain(prof), prof)
    dp = ChainDP(chain.chain)
    least = dp.least_feasible()
    candidates = [none_plan(prof)]
    if least is not None:
        top = chain.chain.capacity
        steps = max(2, points)
        for i in range(steps):
            m = least + round(i * (top - least) / (steps - 1))
            candidates.append(Plan(_items(chain, dp.schedule(m)), prof.fingerprint))
    seen: dict[tuple, FrontierPoint] = {}
    for candidate in candidates:
        if candidate.items in seen:
            continue
        done, pred = finish(prof, candidate, None, "dp")
        seen[candidate.items] = FrontierPoint(pred.peak_bytes, pred.overhead, done)
    pareto: list[FrontierPoint] = []
    for point in sorted(seen.values(), key=lambda p: (p.peak_bytes, p.overhead)):
        if not pareto or point.overhead < pareto[-1].overhead:
            pareto.append(point)
    return pareto
