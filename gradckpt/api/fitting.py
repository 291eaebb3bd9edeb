"""``fit``: plan the step within the budget, apply the plan, and guard every later call.

The plan for ``loss_fn``'s step comes from :mod:`gradckpt.api.fitted`; other
shapes are planned by :mod:`gradckpt.api.shapes`' shape planner, through the
guard it installs; ``compile=`` hands the plan to :mod:`gradckpt.compiled.hold`.

Example:
    >>> plan = gradckpt.fit(model, loss_fn, budget=0.5)
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from gradckpt.api.budget import annotated, budget_and_step, check_step_arguments, held_bytes
from gradckpt.api.checks import check_arguments, check_groups, offload_for
from gradckpt.api.fitted import for_the_running_call, plan_fitted
from gradckpt.api.model_calls import calls_for
from gradckpt.api.old_keywords import accepts_old_keywords
from gradckpt.api.options import LossFn, PlanOptions, ProfileOptions, ShapeOptions, StepOptions
from gradckpt.api.shapes import plan_shape, routed_guard, shape_planner
from gradckpt.apply import guard as shape_guard
from gradckpt.apply.apply import apply, install_guarded
from gradckpt.apply.running import call_running
from gradckpt.planning.kinds.chunk.handler import allow_chunking
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.plans.planset import ShapeKey
from gradckpt.planning.solving.solvers import Solver
from gradckpt.profiling import adapters

__all__ = ["fit"]


@accepts_old_keywords(
    "on_new_shape", "loss_from", "round_up", "seq_dim", "rescale", "blocks", "repeats",
    "profile", "optimizer", "accumulation_steps", "set_to_none",
)  # fmt: skip
def fit(
    model: nn.Module,
    loss_fn: LossFn,
    budget: int | float | str,
    *,
    measure_candidates: int = 3,
    shapes: ShapeOptions | None = None,
    profiling: ProfileOptions | None = None,
    step: StepOptions | None = None,
    solver: str | Solver = "dp",
    segments: bool = True,
    compile: bool | dict[str, Any] = False,
    offload: bool | OffloadOptions = False,
    chunking: bool = True,
) -> Plan:
    """:func:`plan` and :func:`gradckpt.apply` in one call; returns the applied plan.

    The budget then holds when shapes change: every call of the model is checked
    against the shape its plan was made for (:mod:`gradckpt.apply.guard`).

    Args:
        shapes: :class:`gradckpt.ShapeOptions`: shapes to plan now (``planned``; calls
            at them switch plans) and what a call at a shape without a plan does
            (``on_new_shape``: ``"replan"``, the default, plans it under fake tensors
            before it runs, under the same budget in bytes, ``BudgetError`` before
            running if nothing fits; ``"warn"`` runs the old plan, warning once with
            its predicted peak there; ``"error"`` raises ``ShapeError``), with
            ``loss_from``, ``round_up`` (tested for GPT-2, Llama and the GPT of
            ``gradckpt.testing``), ``seq_dim`` and ``rescale``
            (:mod:`gradckpt.planning.solving.rescale`: each new length costs a solve,
            not a profile).
        profiling, step: as for :func:`plan`: pass the optimizer you train with in
            ``step=gradckpt.StepOptions(opt)``, and the budget is your device's memory
            (``budget="auto"`` reads it).
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
        solver, segments, offload, chunking: as for :func:`plan`. Under ``compile``
            plans do not chunk (chunked slices run on the eager engine: fit without
            ``compile`` to chunk).
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

    The keywords the option groups replaced (``repeats=``, ``on_new_shape=``,
    ``optimizer=``, a list as ``shapes=``, ...) still work for one release, with a
    DeprecationWarning.
    """
    shapes, profiling, step = check_groups(shapes, profiling, step)
    read = check_arguments(
        model,
        loss_fn,
        budget,
        blocks=profiling.blocks,
        solver=solver,
        repeats=profiling.repeats,
        profile=profiling.profile,
        segments=segments,
        shapes=shapes.planned,
        loss_from=shapes.loss_from,
    )  # before the model is touched; fmt: skip
    check_step_arguments(step.optimizer, step.accumulation_steps, step.set_to_none)
    offload_opts = offload_for(offload, solver)
    if offload_opts is not None and compile:
        raise ValueError(
            "gradckpt: offload= and compile= cannot be combined yet (offload runs on the "
            "eager engine's saved-tensor hooks); drop one of them"
        )
    if shapes.on_new_shape not in shape_guard.POLICIES:
        raise ValueError(
            f"on_new_shape must be one of {shape_guard.POLICIES}, got {shapes.on_new_shape!r}"
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
    assert read is not None
    resolved = budget_and_step(
        model, read, step.optimizer, step.accumulation_steps, step.set_to_none
    )
    device = resolved.device
    held = held_bytes(model, step.optimizer)
    chunking = bool(chunking) and not compile  # slices run on the eager engine
    options = PlanOptions(
        profiling.blocks, solver, profiling.repeats, profiling.profile, segments, offload_opts,
        resolved.step, held, chunking,
    )  # fmt: skip
    with adapters.training(model):  # transformers: use_cache off for training, said once
        with allow_chunking(chunking):  # candidates measured by kind see it too
            fitted, chosen, prof = plan_fitted(
                model, loss_fn, resolved, options, measure_candidates
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
            planner = shape_planner(model, fitted, chosen.budget_bytes, options, shapes)
            plans: dict[ShapeKey | None, Plan] = {fitted.key: chosen}
            for call in calls_for(fitted, shapes.planned or (), shapes.seq_dim):
                if call.key not in plans:
                    plans[call.key] = plan_shape(planner, call)
            guard = routed_guard(model, plans, fitted.key, planner, shapes, options.step)
            install_guarded(model, chosen, guard)
            if call_running(model):  # fit from inside the model's call (a pre-hook)
                for_the_running_call(model, chosen, prof, options, guard)

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
