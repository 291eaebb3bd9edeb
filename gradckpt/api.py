"""The verbs users call: ``plan``, ``fit``, ``frontier`` (``apply``/``remove`` live in apply/)."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradckpt import integrations, replan
from gradckpt.apply import guard as shape_guard
from gradckpt.apply.apply import apply, install_guarded, install_plan
from gradckpt.plan.budget import BudgetError, check_budget, parse_budget
from gradckpt.plan.chain import build_chain
from gradckpt.plan.costs import with_engine_costs
from gradckpt.plan.dp import ChainDP
from gradckpt.plan.plan import Plan, Segment
from gradckpt.plan.planset import PlanSet, ShapeKey
from gradckpt.plan.simulate import simulate
from gradckpt.plan.solvers import SOLVERS, Solver, _items, finish, none_plan, solve
from gradckpt.profile.fake import fake_model
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
    # A fitted model's shape guard stays out of gradckpt's own profiling passes.
    with shape_guard.paused(model), integrations.preparing(model, fake=bool(options.get("fake"))):
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
    shapes: Sequence[Any] | None = None,
    loss_from: replan.LossFrom | None = None,
    seq_dim: int = 1,
) -> Plan | PlanSet:
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
        shapes: also plan these shapes of the model call (sequence lengths, or example
            inputs: dicts of keyword inputs, tuples of positional ones); each is
            profiled under fake tensors, see :mod:`gradckpt.replan`.
        loss_from: with ``shapes``, how a model call's output becomes the loss.
        seq_dim: with integer ``shapes``, the inputs' sequence dimension.

    Returns:
        A :class:`Plan` with its predicted peak and overhead; with ``shapes``, a
        :class:`PlanSet` holding one plan per shape, under the same budget in bytes.

    Raises:
        BudgetError: no plan fits; the message gives the least reachable peak (and
            which shape, with ``shapes``).

    Example:
        >>> p = gradckpt.plan(model, lambda: model(x).loss, budget="3GiB")
        >>> print(p.summary())
    """
    _check_arguments(model, loss_fn, budget, blocks=blocks, solver=solver, repeats=repeats,
                     profile=profile, segments=segments)  # fmt: skip
    if shapes is None:
        prof = _profile(model, loss_fn, blocks, repeats, profile)
        return solve(
            prof, parse_budget(budget, prof.measured_peak_bytes), solver, segments=segments
        )
    fitted, first, _ = _plan_fitted(
        model, loss_fn, budget, blocks, solver, repeats, profile, segments
    )
    if fitted is None:
        raise ValueError(
            f"gradckpt: loss_fn never called {type(model).__name__}'s own forward, so there is "
            "no input whose shapes= could be varied; plan the module the step calls"
        )
    plans = {fitted.key: first}
    planner = _planner(
        model, fitted, first.budget_bytes, blocks, solver, segments, loss_from, seq_dim
    )
    for call in replan.calls_for(fitted, shapes, seq_dim):
        if call.key not in plans:
            plans[call.key] = _plan_shape(planner, call)
    return PlanSet(tuple(plans.items()))


# ------------------------------------------------------------- shapes (#9)


def _plan_fitted(
    model: nn.Module,
    loss_fn: LossFn,
    budget: int | float | str,
    blocks: BlockSpec,
    solver: str | Solver,
    repeats: int,
    given: Profile | None,
    segments: bool,
    measure_candidates: int = 0,
) -> tuple[replan.Call | None, Plan, Profile]:
    """The plan for ``loss_fn``'s step, the model call it makes (its shape key), its profile.

    The call is seen while the step runs (profiling, or measuring candidates);
    with a given profile and nothing measured, under fake tensors.
    """
    recording = replan.capture_call(model, loss_fn)
    prof = given if given is not None else profile(model, recording, blocks=blocks, repeats=repeats)
    calls = recording.calls  # type: ignore[attr-defined]
    if given is None and not calls:
        # The step never runs the model's own forward (a trainer calling its parts):
        # a segment opens only inside that forward, so plan unit by unit.
        segments = False
    budget_bytes = parse_budget(budget, prof.measured_peak_bytes)
    chosen = solve(prof, budget_bytes, solver, segments=segments)
    measured = measure_candidates and not prof.fake
    if measured:
        from gradckpt.apply.select import fastest_measured

        count = measure_candidates if solver == "dp" else 1
        with shape_guard.paused(model):  # candidates are applied and run by hand
            chosen = fastest_measured(model, recording, prof, chosen, count, segments=segments)
    if not calls and given is not None:
        if not measured:  # nothing ran for real yet
            preparing = integrations.preparing(model, fake=True)
            with preparing, torch.no_grad(), fake_model(model) as mode, mode:
                recording()  # only to see the call's shapes; nothing is allocated
        if not calls and segments and any(isinstance(i, Segment) for i in chosen.items):
            # Known only now that the forward is never called: its segments would not open.
            chosen = solve(prof, budget_bytes, solver, segments=False)
    # None: the step never calls the model's own forward, so no call's shape to guard.
    return (calls[0] if calls else None), chosen, prof


def _planner(
    model: nn.Module,
    fitted: replan.Call,
    budget_bytes: int | None,
    blocks: BlockSpec,
    solver: str | Solver,
    segments: bool,
    loss_from: replan.LossFrom | None,
    seq_dim: int,
    rescale: bool = True,
) -> replan.ShapePlanner:
    assert budget_bytes is not None

    def profile_fake(step: LossFn) -> Profile:
        return profile(model, step, blocks=blocks, fake=True)

    def solve_profile(prof: Profile) -> Plan:
        return solve(prof, budget_bytes, solver, segments=segments)

    return replan.ShapePlanner(
        model, fitted, loss_from, profile_fake, solve_profile, seq_dim=seq_dim, rescale=rescale
    )


def _plan_shape(planner: Callable[[replan.Call], Plan], call: replan.Call) -> Plan:
    try:
        return planner(call)
    except BudgetError as exc:
        raise BudgetError(
            f"at input shape {call.key.describe()}: {exc}", exc.least_peak_bytes
        ) from exc


def _guard(
    model: nn.Module,
    on_new_shape: str,
    plans: dict[ShapeKey | None, Plan],
    active: ShapeKey,
    planner: replan.ShapePlanner,
    round_up: bool,
) -> shape_guard.ShapeGuard:
    def plan_new(args: tuple, kwargs: dict) -> Plan:
        return planner(replan.Call(args, kwargs, replan.shape_key(args, kwargs)))

    def predict(chosen: Plan, args: tuple, kwargs: dict) -> int:
        call = replan.Call(args, kwargs, replan.shape_key(args, kwargs))
        return simulate(planner.profile_call(call), chosen).peak_bytes

    return shape_guard.ShapeGuard(
        on_new_shape,
        plans,
        active,
        lambda p: install_plan(model, p),
        planner=plan_new,
        predictor=predict,
        round_up=round_up,
        rescaled=lambda: planner.rescaled,
    )


def fit(
    model: nn.Module,
    loss_fn: LossFn,
    budget: int | float | str,
    *,
    on_new_shape: str = "replan",
    shapes: Sequence[Any] | None = None,
    loss_from: replan.LossFrom | None = None,
    round_up: bool = False,
    seq_dim: int = 1,
    rescale: bool = True,
    measure_candidates: int = 2,
    blocks: BlockSpec = None,
    solver: str | Solver = "dp",
    repeats: int = 3,
    profile: Profile | None = None,
    segments: bool = True,
    compile: bool | dict[str, Any] = False,
) -> Plan:
    """:func:`plan` and :func:`gradckpt.apply` in one call; returns the applied plan.

    The budget then holds when shapes change: every call of the model is checked
    against the shape its plan was made for (:mod:`gradckpt.apply.guard`).

    Args:
        on_new_shape: what a call at a shape without a plan does. ``"replan"``
            (default): plan it under fake tensors before it runs, under the same
            budget in bytes (``BudgetError`` before running if nothing fits);
            ``"warn"``: run the old plan, warning once with its predicted peak
            there; ``"error"``: raise ``ShapeError``.
        shapes: shapes to plan now (see :func:`plan`); calls at them switch plans.
        loss_from: ``(output, *args, **kwargs) -> loss``: how a model call becomes
            the training loss when planning a new shape (default: ``output.loss``
            if the output has one, else the sum of its floating tensors).
        round_up: a call whose shape is bounded in every dimension by a planned
            shape runs under the smallest such plan instead of being planned.
            Only for models whose peak is monotone in the input shape (tested for
            GPT-2, Llama and the GPT of ``gradckpt.testing``).
        seq_dim: the sequence dimension: integer ``shapes`` resize it, and a call that
            changes only it is planned by rescaling (below).
        rescale: plan a call that changes only the sequence length from profiles at
            four lengths rescaled exactly (:mod:`gradckpt.plan.rescale`; built at the
            first such call, then each new length costs a solve, not a profile);
            False profiles every new shape under fake tensors.
        measure_candidates: how many plans that fit (the planner's, the best one
            that keeps or recomputes each unit whole, then the next fastest
            predicted) to run for 3 real steps each, interleaved with the
            plain step, keeping the fastest measured (:mod:`gradckpt.apply.select`).
            It costs ``3 * (measure_candidates + 1)`` training steps: 9 by default,
            about what profiling costs. The plan records ``measured_overhead`` next
            to ``predicted_overhead``. 0 turns it off; fake profiles are never
            measured, nor are the plans made for other shapes.
        blocks, solver, repeats, profile, segments: as for :func:`plan`.
        compile: True or ``torch.compile`` arguments: run the plan inside one
            compiled graph (:func:`gradckpt.compile`; plans then have no
            segments). A call at a new shape reinstalls the eager plan for it.

    Example:
        >>> plan = gradckpt.fit(model, loss_fn, budget=0.5)
        >>> plan.predicted_overhead, plan.measured_overhead
        >>> print(gradckpt.shape_stats(model).summary())
        >>> gradckpt.fit(model, loss_fn, budget=0.5, compile={"backend": "inductor"})
    """
    if compile:
        segments = False  # the compiler checkpoints one call per region: no segments
    _check_arguments(
        model,
        loss_fn,
        budget,
        blocks=blocks,
        solver=solver,
        repeats=repeats,
        profile=profile,
        segments=segments,
    )  # before the model is touched; fmt: skip
    if on_new_shape not in shape_guard.POLICIES:
        raise ValueError(
            f"on_new_shape must be one of {shape_guard.POLICIES}, got {on_new_shape!r}"
        )
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
        fitted, chosen, _ = _plan_fitted(
            model, loss_fn, budget, blocks, solver, repeats, profile, segments, measure_candidates
        )
        if fitted is None:
            warnings.warn(
                f"gradckpt: loss_fn never called {type(model).__name__}'s own forward, so "
                "calls at new shapes cannot be guarded: the plan stays as made for this "
                "batch's shapes. Fit the module the step calls to have them guarded.",
                stacklevel=2,
            )
            apply(model, chosen)
            return chosen
        planner = _planner(
            model, fitted, chosen.budget_bytes, blocks, solver, segments, loss_from, seq_dim,
            rescale,
        )  # fmt: skip
        plans: dict[ShapeKey | None, Plan] = {fitted.key: chosen}
        for call in replan.calls_for(fitted, shapes or (), seq_dim):
            if call.key not in plans:
                plans[call.key] = _plan_shape(planner, call)
        guard = _guard(model, on_new_shape, plans, fitted.key, planner, round_up)
        install_guarded(model, chosen, guard)
    if compile:
        from gradckpt.integrations.compiled import compile as compile_planned

        compile_planned(model, loss_fn, **(compile if isinstance(compile, dict) else {}))
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
