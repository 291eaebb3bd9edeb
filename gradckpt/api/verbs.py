"""The verbs users call: ``profile``, ``plan``, ``frontier``, ``explain`` (``fit``: :mod:`~gradckpt.api.fitting`).

The top of the library's planning side: arguments are checked in the user's
terms (:mod:`~gradckpt.api.checks`), then every verb profiles through the one
profiling path (:func:`gradckpt.profiling.run.profile`, which consults the
registered adapters) and asks a :class:`~gradckpt.planning.planner.Planner`.
``apply``/``remove`` live in apply/; the plan at the fitted shape is
:mod:`gradckpt.api.fitted`'s, plans at other shapes :mod:`gradckpt.api.shapes`'.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gradckpt.api.budget import annotated, budget_and_step, held_bytes, training_step
from gradckpt.api.checks import check_arguments, check_groups, offload_for
from gradckpt.api.fitted import plan_fitted
from gradckpt.api.model_calls import calls_for
from gradckpt.api.old_keywords import accepts_old_keywords
from gradckpt.api.options import LossFn, PlanOptions, ProfileOptions, ShapeOptions, StepOptions
from gradckpt.api.shapes import plan_shape, shape_planner
from gradckpt.apply.apply import applied_plan
from gradckpt.planning.explaining.explain import Explanation
from gradckpt.planning.kinds.chunk.handler import allow_chunking
from gradckpt.planning.planner import FrontierPoint, Planner
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.plans.planset import PlanSet
from gradckpt.planning.solving.budget import Budget
from gradckpt.planning.solving.solvers import Solver
from gradckpt.planning.solving.whole_step import with_training_step
from gradckpt.profiling.records import Profile
from gradckpt.profiling.run import profile as profile_step
from gradckpt.profiling.units import BlockSpec

__all__ = ["FrontierPoint", "explain", "frontier", "plan", "profile"]

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


def _profile(model: nn.Module, loss_fn: LossFn, options: PlanOptions) -> Profile:
    if options.profile is not None:
        return with_training_step(options.profile, options.step)
    prof = profile_step(model, loss_fn, blocks=options.blocks, repeats=options.repeats)
    return with_training_step(prof, options.step)


@accepts_old_keywords(
    "loss_from", "seq_dim", "blocks", "repeats", "profile", "optimizer", "accumulation_steps",
    "set_to_none",
)  # fmt: skip
def plan(
    model: nn.Module,
    loss_fn: LossFn,
    budget: int | float | str,
    *,
    shapes: ShapeOptions | None = None,
    profiling: ProfileOptions | None = None,
    step: StepOptions | None = None,
    solver: str | Solver = "dp",
    segments: bool = True,
    offload: bool | OffloadOptions = False,
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
            (:mod:`gradckpt.api.budget`).
        shapes: :class:`gradckpt.ShapeOptions`: also plan the shapes ``planned`` of the
            model call (sequence lengths, or example inputs), each profiled under fake
            tensors (:mod:`gradckpt.api.shape_planner`), with ``loss_from`` and ``seq_dim``.
        profiling: :class:`gradckpt.ProfileOptions`: the blocks, the profiled steps
            (``repeats``), or a ``profile`` from ``gradckpt.profile(...)`` to reuse.
        step: :class:`gradckpt.StepOptions`: count the whole training step: its
            ``optimizer`` (state and ``step()`` temporaries predicted on fake tensors,
            :func:`gradckpt.measure.optimizer_memory`; the plan's peak is then the
            step's whole peak, in parts in ``plan.step``), ``accumulation_steps`` and
            ``set_to_none``. None: not counted (the summary says so).
        solver: "dp" (default) or a baseline name from ``gradckpt.planning.solving.solvers.SOLVERS``.
        segments: allow regions that span several units (False for FSDP, whose
            units' parameters are sharded when a segment would recompute them).
        offload: also consider moving blocks' saved tensors to host memory (the DP
            chooses keep, recompute or offload per block): True (a 25 GB/s link, no
            host budget) or :class:`gradckpt.OffloadOptions` (bandwidth, host budget,
            min bytes). On CPU the time it costs is simulated from that bandwidth.
        chunking: let an LM head and the cross-entropy after it run in slices of
            tokens, each recomputed (``Chunk`` in the plan), where that pays under the
            budget: the logits are never whole. Exact up to the order of
            floating-point sums; False keeps plans bit for bit as without it.

    The keywords these groups replaced (``repeats=``, ``optimizer=``, ``seq_dim=``, a
    list as ``shapes=``, ...) still work for one release, with a DeprecationWarning.

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
    shapes, profiling, step = check_groups(shapes, profiling, step)
    planned = shapes.planned
    read = check_arguments(model, loss_fn, budget, blocks=profiling.blocks, solver=solver,
                           repeats=profiling.repeats, profile=profiling.profile,
                           segments=segments, shapes=planned,
                           loss_from=shapes.loss_from)  # fmt: skip
    assert read is not None
    resolved = budget_and_step(  # the step's arguments are checked first
        model, read, step.optimizer, step.accumulation_steps, step.set_to_none
    )
    device, whole_step = resolved.device, resolved.step
    offload_opts = offload_for(offload, solver)
    held = held_bytes(model, step.optimizer)
    options = PlanOptions(
        profiling.blocks, solver, profiling.repeats, profiling.profile, segments, offload_opts,
        whole_step, held, bool(chunking),
    )  # fmt: skip
    if planned is None and profiling.profile is not None:  # loss_fn never runs
        whole = with_training_step(profiling.profile, whole_step)
        planner = Planner(whole, segments=segments, offload=offload_opts, chunking=chunking)
        return annotated(planner.plan(resolved, solver), device)
    with allow_chunking(options.chunking):
        if planned is None:  # profiled within the budget (never the plain step above it)
            return annotated(plan_fitted(model, loss_fn, resolved, options)[1], device)
        fitted, first, _ = plan_fitted(model, loss_fn, resolved, options)
    first = annotated(first, device)
    if fitted is None:
        raise ValueError(
            f"gradckpt: loss_fn never called {type(model).__name__}'s own forward, so there is "
            "no input whose shapes= could be varied; plan the module the step calls"
        )
    plans = {fitted.key: first}
    planner = shape_planner(model, fitted, first.budget_bytes, options, shapes)
    for call in calls_for(fitted, planned, shapes.seq_dim):
        if call.key not in plans:
            plans[call.key] = plan_shape(planner, call)
    return PlanSet(tuple(plans.items()))


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
    offload_opts = offload_for(offload, "dp")
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
    read = Budget.read(budget) if budget is not None else None
    offload_opts = offload_for(offload, "dp")
    if isinstance(model_or_profile, Profile):
        prof = model_or_profile
    else:
        if loss_fn is None:
            raise TypeError("explain(model, loss_fn): a model needs its loss_fn")
        check_arguments(model_or_profile, loss_fn, blocks=blocks)
        if plan is None and budget is None:
            plan = applied_plan(model_or_profile)
        prof = profile_step(model_or_profile, loss_fn, blocks=blocks, repeats=1)
    return Planner(prof, offload=offload_opts, chunking=chunking).explain(read, plan)
