"""The verbs users call: ``profile``, ``plan``, ``fit``, ``frontier``, ``explain``.

The top of the library's planning side: arguments are checked here in the
user's terms, then every verb profiles through the one profiling path
(:func:`gradckpt.profiling.run.profile`, which consults the registered adapters)
and asks a :class:`~gradckpt.planning.planner.Planner`. ``apply``/``remove`` live in
apply/; the shape side of ``plan``/``fit`` in :mod:`gradckpt.api_shapes`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradckpt import api_shapes, replan
from gradckpt.api_budget import (
    annotated,
    budget_and_step,
    check_step_arguments,
    held_bytes,
    training_step,
)
from gradckpt.api_checks import check_arguments
from gradckpt.api_shapes import PlanOptions, ShapeHandling
from gradckpt.apply import guard as shape_guard
from gradckpt.apply.apply import applied_plan, apply, install_guarded
from gradckpt.apply.running import call_running
from gradckpt.planning.explaining.explain import Explanation
from gradckpt.planning.kinds.chunk.handler import allow_chunking
from gradckpt.planning.planner import FrontierPoint, Planner
from gradckpt.planning.plans.offload_options import OffloadOptions, offload_options
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.plans.planset import PlanSet, ShapeKey
from gradckpt.planning.solving.budget import check_budget
from gradckpt.planning.solving.solvers import Solver
from gradckpt.planning.solving.whole_step import with_training_step
from gradckpt.profiling import adapters
from gradckpt.profiling.records import Profile
from gradckpt.profiling.run import profile as profile_step
from gradckpt.profiling.units import BlockSpec

__all__ = ["FrontierPoint", "explain", "fit", "frontier", "plan", "profile"]

LossFn = Callable[[], torch.Tensor]


def profile(
    model: nn.Module,
    loss_fn: LossFn,
    *,
    optimizer: Any = None,
    accumulation_steps: int = 1,
    set_to_none: bool = True,
    **options: Any,
) -> Profile:
    """Measure one training step (``gradckpt.profile``); see :func:`gradckpt.profiling.run.profile`.

    Registered adapters prepare the model first (transformers: no KV cache while
    profiling); a fitted model's shape guard stays out of the profiling passes.
    With ``optimizer``, ``accumulation_steps`` or ``set_to_none=False`` the profile
    counts the whole training step (see :func:`plan`), so plans made from it do too.

    Example:
        >>> prof = gradckpt.profile(model, loss_fn, fake=True)
        >>> whole = gradckpt.profile(model, loss_fn, optimizer=opt, accumulation_steps=4)
    """
    check_arguments(
        model, loss_fn, blocks=options.get("blocks"), repeats=options.get("repeats", 3)
    )
    step = training_step(model, optimizer, accumulation_steps, set_to_none)  # checks them first
    return with_training_step(profile_step(model, loss_fn, **options), step)


def _offload_for(offload: object, solver: object) -> OffloadOptions | None:
    """``offload=`` checked and as options (None: off)."""
    options = offload_options(offload)
    if options is not None and solver != "dp":
        raise ValueError(
            f"offload= works with solver='dp' (the baselines only recompute); got solver={solver!r}"
        )
    return options


def _profile(model: nn.Module, loss_fn: LossFn, options: PlanOptions) -> Profile:
    if options.profile is not None:
        return with_training_step(options.profile, options.step)
    prof = profile_step(model, loss_fn, blocks=options.blocks, repeats=options.repeats)
    return with_training_step(prof, options.step)


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
    offload: bool | OffloadOptions = False,
    optimizer: Any = None,
    accumulation_steps: int = 1,
    set_to_none: bool = True,
    chunking: bool = True,
) -> Plan | PlanSet:
    """The least-recompute checkpointing plan whose peak fits ``budget``; the model is untouched.

    Args:
        model: the model to plan for.
        loss_fn: zero-argument callable: one forward on a representative batch, returns the loss.
            Called ``1 + 2 * repeats`` times while profiling (see :func:`gradckpt.profile`);
            everything it touches is left as found.
        budget: bytes (int), a string with units ("800MB", "1.5GiB"), ``"auto"`` (the
            memory of the device the model is on, less a stated headroom:
            :mod:`gradckpt.measure.device`), or a float in (0, 1] meaning that fraction
            of the uncheckpointed peak. A budget in bytes is never exceeded while
            planning: when the plain step may not fit it, the step is profiled under
            fake tensors and checked on steps under plans that fit
            (:mod:`gradckpt.api_budget`).
        blocks: the repeated blocks (paths or predicate); found automatically if None.
        solver: "dp" (default) or a baseline name from ``gradckpt.planning.solving.solvers.SOLVERS``.
        repeats: profiled steps to take median op times from.
        profile: a profile from ``gradckpt.profile(...)`` to reuse instead of measuring.
        segments: allow regions that span several units (False for FSDP, whose
            units' parameters are sharded when a segment would recompute them).
        shapes: also plan these shapes of the model call (sequence lengths, or example
            inputs: dicts of keyword inputs, tuples of positional ones); each is
            profiled under fake tensors, see :mod:`gradckpt.replan`.
        loss_from: with ``shapes``, how a model call's output becomes the loss.
        seq_dim: with integer ``shapes``, the inputs' sequence dimension.
        offload: also consider moving blocks' saved tensors to host memory (the DP
            chooses keep, recompute or offload per block): True (a 25 GB/s link, no
            host budget) or :class:`gradckpt.OffloadOptions` (bandwidth, host budget,
            min bytes). On CPU the time it costs is simulated from that bandwidth.
        optimizer: count the whole training step: a live ``torch.optim.Optimizer``, a
            class or ``(class, kwargs)``, or a name ("adamw", "sgd", ...). Its state and
            ``step()`` temporaries are predicted on fake tensors
            (:func:`gradckpt.measure.optimizer_memory`); the plan's peak is then the
            step's whole peak, in parts in ``plan.step``. None: not counted (the
            summary says so).
        accumulation_steps: micro-batches per optimizer step; from the second on the
            gradients are resident through forward and backward.
        set_to_none: False when gradients are zeroed in place (resident always).
        chunking: let an LM head and the cross-entropy after it run in slices of
            tokens, each recomputed (``Chunk`` in the plan), where that pays under the
            budget: the logits are never whole. Exact up to the order of
            floating-point sums; False keeps plans bit for bit as without it.

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
    check_arguments(model, loss_fn, budget, blocks=blocks, solver=solver, repeats=repeats,
                    profile=profile, segments=segments, shapes=shapes,
                    loss_from=loss_from)  # fmt: skip
    budget, device, step = budget_and_step(  # the step's arguments are checked first
        model, budget, optimizer, accumulation_steps, set_to_none
    )
    offload_opts = _offload_for(offload, solver)
    held = held_bytes(model, optimizer)
    options = PlanOptions(
        blocks, solver, repeats, profile, segments, offload_opts, step, held, bool(chunking)
    )
    if shapes is None and profile is not None:  # plans from the profile: loss_fn never runs
        whole = with_training_step(profile, step)
        planner = Planner(whole, segments=segments, offload=offload_opts, chunking=chunking)
        return annotated(planner.plan(budget, solver), device)
    with allow_chunking(options.chunking):
        if shapes is None:  # profiled within the budget (never the plain step above it)
            return annotated(api_shapes.plan_fitted(model, loss_fn, budget, options)[1], device)
        fitted, first, _ = api_shapes.plan_fitted(model, loss_fn, budget, options)
    first = annotated(first, device)
    if fitted is None:
        raise ValueError(
            f"gradckpt: loss_fn never called {type(model).__name__}'s own forward, so there is "
            "no input whose shapes= could be varied; plan the module the step calls"
        )
    plans = {fitted.key: first}
    handling = ShapeHandling(loss_from=loss_from, seq_dim=seq_dim)
    planner = api_shapes.shape_planner(model, fitted, first.budget_bytes, options, handling)
    for call in replan.calls_for(fitted, shapes, seq_dim):
        if call.key not in plans:
            plans[call.key] = api_shapes.plan_shape(planner, call)
    return PlanSet(tuple(plans.items()))


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
    measure_candidates: int = 3,
    blocks: BlockSpec = None,
    solver: str | Solver = "dp",
    repeats: int = 3,
    profile: Profile | None = None,
    segments: bool = True,
    compile: bool | dict[str, Any] = False,
    offload: bool | OffloadOptions = False,
    optimizer: Any = None,
    accumulation_steps: int = 1,
    set_to_none: bool = True,
    chunking: bool = True,
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
            four lengths rescaled exactly (:mod:`gradckpt.planning.solving.rescale`; built at the
            first such call, then each new length costs a solve, not a profile);
            False profiles every new shape under fake tensors.
        measure_candidates: how many plans that fit to run for 3 real steps each,
            interleaved with the plain step, keeping the fastest measured
            (:mod:`gradckpt.apply.select`): the planner's, then the best plan of each
            other kind that fits (whole-unit, each unit kept or recomputed whole;
            selective; segments over several units), then the next fastest
            predicted. It costs ``3 * (measure_candidates + 1)`` training steps: 12
            by default (3 candidates, so one of each kind is measured: a kind the
            cost model prices wrong cannot win unmeasured), about what profiling
            costs. The plan records ``measured_overhead`` next to
            ``predicted_overhead``. 0 turns it off; fake profiles are never
            measured, nor are the plans made for other shapes.
        blocks, solver, repeats, profile, segments, offload, chunking: as for
            :func:`plan`. Under ``compile`` plans do not chunk (chunked slices run on the
            eager engine: fit without ``compile`` to chunk).
        optimizer, accumulation_steps, set_to_none: the whole training step, as for
            :func:`plan`: pass the optimizer you train with, and the budget is your
            device's memory (``budget="auto"`` reads it).
        compile: True or ``torch.compile`` arguments: run the plan inside one
            compiled graph (:func:`gradckpt.compile`; segments included). The
            budget is then held at the allocator, measured: one compiled step is
            measured, and one over the budget is planned again tighter and
            recompiled (up to 3 compiles, :mod:`gradckpt.compiled.hold`);
            the plan records ``measured_compiled_peak_bytes``. ``BudgetError``
            (the model left plain) if none fits. A call at a new shape
            reinstalls the eager plan for it (not measured compiled).

    Example:
        >>> plan = gradckpt.fit(model, loss_fn, budget=0.5)
        >>> plan.predicted_overhead, plan.measured_overhead
        >>> print(gradckpt.shape_stats(model).summary())
        >>> gradckpt.fit(model, loss_fn, budget=0.5, compile={"backend": "inductor"})
    """
    check_arguments(
        model,
        loss_fn,
        budget,
        blocks=blocks,
        solver=solver,
        repeats=repeats,
        profile=profile,
        segments=segments,
        shapes=shapes,
        loss_from=loss_from,
    )  # before the model is touched; fmt: skip
    check_step_arguments(optimizer, accumulation_steps, set_to_none)
    offload_opts = _offload_for(offload, solver)
    if offload_opts is not None and compile:
        raise ValueError(
            "gradckpt: offload= and compile= cannot be combined yet (offload runs on the "
            "eager engine's saved-tensor hooks); drop one of them"
        )
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
    budget, device, step = budget_and_step(
        model, budget, optimizer, accumulation_steps, set_to_none
    )
    held = held_bytes(model, optimizer)
    chunking = bool(chunking) and not compile  # slices run on the eager engine
    options = PlanOptions(
        blocks, solver, repeats, profile, segments, offload_opts, step, held, chunking
    )
    handling = ShapeHandling(on_new_shape, loss_from, round_up, seq_dim, rescale)
    with adapters.training(model):  # transformers: use_cache off for training, said once
        with allow_chunking(chunking):  # candidates measured by kind see it too
            fitted, chosen, prof = api_shapes.plan_fitted(
                model, loss_fn, budget, options, measure_candidates
            )
        chosen = annotated(chosen, device)
        if fitted is None:
            warnings.warn(
                f"gradckpt: loss_fn never called {type(model).__name__}'s own forward, so "
                "calls at new shapes cannot be guarded: the plan stays as made for this "
                "batch's shapes. Fit the module the step calls to have them guarded.",
                stacklevel=2,
            )
            apply(model, chosen)

            def put(held: Plan) -> None:
                apply(model, held)
        else:
            planner = api_shapes.shape_planner(
                model, fitted, chosen.budget_bytes, options, handling
            )
            plans: dict[ShapeKey | None, Plan] = {fitted.key: chosen}
            for call in replan.calls_for(fitted, shapes or (), seq_dim):
                if call.key not in plans:
                    plans[call.key] = api_shapes.plan_shape(planner, call)
            guard = api_shapes.guard(model, plans, fitted.key, planner, handling, options.step)
            install_guarded(model, chosen, guard)
            if call_running(model):  # fit from inside the model's call (a pre-hook)
                api_shapes.for_the_running_call(model, chosen, prof, options, guard)

            def put(held: Plan) -> None:
                plans[fitted.key] = held
                install_guarded(model, held, guard)

    if compile:
        from gradckpt.compiled.hold import compile_within_budget

        # Tighter plans come from the same profile (segments as plan_fitted allowed them).
        tighter = Planner(prof, segments=segments and fitted is not None, chunking=False)
        kwargs = compile if isinstance(compile, dict) else {}
        chosen = compile_within_budget(model, loss_fn, chosen, tighter, solver, put, **kwargs)
        if fitted is not None:
            plans[fitted.key] = chosen  # the guard's record carries the measured peak too
    return chosen


def frontier(
    model: nn.Module,
    loss_fn: LossFn,
    *,
    points: int = 32,
    blocks: BlockSpec = None,
    repeats: int = 3,
    profile: Profile | None = None,
    offload: bool | OffloadOptions = False,
    chunking: bool = True,
) -> list[FrontierPoint]:
    """The memory-time Pareto curve, from the least feasible peak to the plain step.

    With ``offload``, the plans that also offload blocks join the candidates
    (planned at each candidate's peak), so the curve is at or below the one
    without offload everywhere.

    Example:
        >>> for point in gradckpt.frontier(model, loss_fn):
        ...     print(point.peak_bytes, f"{point.overhead:+.1%}")
    """
    check_arguments(model, loss_fn, blocks=blocks, repeats=repeats, profile=profile)
    options = PlanOptions(blocks=blocks, repeats=repeats, profile=profile)
    offload_opts = _offload_for(offload, "dp")
    planner = Planner(_profile(model, loss_fn, options), offload=offload_opts, chunking=chunking)
    return planner.frontier(points)


def explain(
    model_or_profile: nn.Module | Profile,
    loss_fn: LossFn | None = None,
    plan: Plan | None = None,
    *,
    budget: int | float | str | None = None,
    blocks: BlockSpec = None,
    offload: bool | OffloadOptions = False,
    chunking: bool = True,
) -> Explanation:
    """Every storage the step keeps for backward, why, the totals and the peak.

    Args:
        model_or_profile: a model (profiled once with ``loss_fn``) or a :class:`Profile`.
        loss_fn: zero-argument callable returning the loss; needed with a model.
        plan: the plan to explain; None explains the plain step (or, for a model,
            the plan :func:`gradckpt.apply` installed on it).
        budget: instead of ``plan``, plan for this budget first (see :func:`plan`).
        blocks: block paths or predicate, passed to the profiler.
        offload: with ``budget``, plan with offload too (see :func:`plan`);
            offloaded units say what moves, when, and what the link costs.
        chunking: with ``budget``, as for :func:`plan`.

    Returns:
        An :class:`~gradckpt.planning.explaining.explain.Explanation`: ``rows``, ``units``,
        ``kept_bytes``, ``recomputed_bytes``, ``peak``; ``table()`` and ``to_json()``.

    Example:
        >>> print(gradckpt.explain(model, loss_fn, budget="2GiB").table())
    """
    if budget is not None:
        check_budget(budget)
    offload_opts = _offload_for(offload, "dp")
    if isinstance(model_or_profile, Profile):
        prof = model_or_profile
    else:
        if loss_fn is None:
            raise TypeError("explain(model, loss_fn): a model needs its loss_fn")
        check_arguments(model_or_profile, loss_fn, blocks=blocks)
        if plan is None and budget is None:
            plan = applied_plan(model_or_profile)
        prof = profile_step(model_or_profile, loss_fn, blocks=blocks, repeats=1)
    return Planner(prof, offload=offload_opts, chunking=chunking).explain(budget, plan)
