"""Pipeline parallelism: each stage planned for the micro-batches its schedule keeps in flight.

With ``torch.distributed.pipelining`` a rank runs one stage, and its schedule
decides how many micro-batches' activations the stage holds at once
(:func:`~gradckpt.integrations.pipeline_schedules.in_flight`: ``P - s`` under 1F1B,
all ``M`` under GPipe). So the stages need different plans under one device
budget: the first stage of a 1F1B pipeline holds ``P`` micro-batches, the last one.

**The stage's peak.** gradckpt profiles the stage's module on one micro-batch
(the first stage from its tokens; a middle stage from a received activation that
requires grad, its backward fed a gradient the size of its output; the last
stage through the schedule's loss), with the training step folded in: the
optimizer (its state, its step's temporaries) and gradients resident from the
second micro-batch on (the schedule accumulates them over ``M``). Under a plan,
with ``k`` micro-batches in flight, the stage's peak is the largest of three moments::

    forward/backward   fwd_bwd_peak(plan) + (k - 1) * held(plan) + buffers + outputs
    optimizer step     optimizer_step_peak + buffers + outputs
    end of the step    parameters + gradients + optimizer state + buffers + 2 * outputs
                       (only when the outputs are returned)

``held(plan)`` is what one micro-batch keeps from the end of its forward to its
backward under the plan (the simulator's level there). ``buffers`` are the
stage's communication buffers, made in the first step and kept: ``PipelineStage``
allocates one receive buffer per micro-batch for its input (every stage but the
first) and one for its output's gradient (every stage but the last), ``M`` of each,
and a stage that sends gradients back holds one input gradient being sent while
it makes the next.
``outputs`` is what the last stage holds of its outputs (the logits): the
stage keeps each micro-batch's output until its backward (``k`` of them, which
the profiled loss lets go once the loss is computed), and when ``schedule.step``
returns them (``return_outputs=True``, torch's default) all ``M`` until the next
step starts; at the end of such a step they are merged into one more tensor of
that size while the pieces are still alive.

The plan chosen per stage is the fastest predicted
one whose stage peak fits the budget, among the DP's Pareto plans and the DP's
plans for a search over single-micro-batch budgets.

**Time per micro-batch** is the stage's plain step (forward and backward of one
micro-batch) plus what the plan recomputes, priced by the simulator. On ranks of
one process group the plain step is timed again with every rank timing its own
stage at once, as the schedule runs them
(:mod:`~gradckpt.integrations.pipeline_timing`), and the op times scaled to it.

**Per rank.** Every rank calls :func:`plan_stage` on its own stage (profiling only
its own module, or under fake tensors) and :func:`gradckpt.apply` (or
:func:`fit_stage`); :func:`~gradckpt.integrations.pipeline_report.gather_stage_plans`
collects every rank's :class:`StagePlan` for the table. :func:`plan_stages` plans
all stages in one process (the CLI, benchmarks, fake planning of big models).

**With FSDP2 inside a stage** (``fsdp_world_size``): the stage's parameters are
counted as :func:`~gradckpt.integrations.distributed.rank_memory` says one FSDP
rank holds them, and plans have no segments, as for :func:`plan_for_fsdp`.

Example:
    >>> sp = fit_stage(stage_mod, (x_mb,), "2GiB", schedule=schedule, optimizer="adamw")
    >>> print(summary(gather_stage_plans(sp)))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gradckpt.api.budget import training_step
from gradckpt.apply.apply import apply
from gradckpt.integrations.pipeline_cost import (
    StageCost,
    StageParts,
    output_bytes,
    stage_cost,
    tensor_bytes,
)
from gradckpt.integrations.pipeline_report import (
    StagePlan,
    UniformPoint,
    compare,
    gather_stage_plans,
    summary,
)
from gradckpt.integrations.pipeline_schedules import in_flight, schedule_name, schedule_shape
from gradckpt.integrations.pipeline_timing import in_process_group, retimed_to, time_together
from gradckpt.integrations.pipeline_traced import traced_block_paths
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.solving.baselines import (
    every_kth_plan,
    finish,
    none_plan,
    save_matmuls_plan,
)
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.whole_step import with_training_step
from gradckpt.profiling.records import Profile
from gradckpt.profiling.run import profile as profile_step

__all__ = [
    "StageCost",
    "StageParts",
    "StagePlan",
    "compare",
    "fit_stage",
    "gather_stage_plans",
    "in_flight",
    "plan_stage",
    "plan_stages",
    "stage_cost",
    "stage_loss_fn",
    "summary",
]

LossFn = Callable[[], torch.Tensor]
#: Uniform settings compared with the per-stage plans: the same on every stage, as
#: torchtitan's activation-checkpoint modes and Megatron's recompute options are.
UNIFORM = {
    "none": none_plan,
    "every_block": lambda p: every_kth_plan(p, 1),  # torchtitan "full", Megatron "full"
    "every_2nd_block": lambda p: every_kth_plan(p, 2),  # torchtitan selective layer, freq 2
    "save_matmuls": save_matmuls_plan,  # torchtitan selective op (keeps matmul outputs)
}
_SEARCH_STEPS = 12


def stage_loss_fn(
    module: nn.Module,
    inputs: Sequence[Any],
    *,
    loss: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    received: bool = True,
) -> LossFn:
    """One micro-batch of a stage as a zero-argument loss, the way the schedule runs it.

    With ``loss`` (the last stage): ``loss(module(*inputs), target)``. Otherwise the
    backward is fed a gradient of ones the size of the output, made in the step as
    the received gradient is. With ``received`` (every stage but the first), floating
    inputs require grad (a received activation: its gradient is computed and sent back).

    Example:
        >>> loss_fn = stage_loss_fn(stage1, (hidden,), loss=cross_entropy, target=y)
    """
    args = tuple(
        t.detach().requires_grad_(True)
        if received and isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in inputs
    )  # fmt: skip

    if loss is not None:
        return lambda: loss(module(*args), target)

    def fed() -> torch.Tensor:
        out = module(*args)
        return (out * torch.ones_like(out)).sum()  # d(sum)/d(out) = the received ones

    return fed


def _choose(
    planner: Planner, budget: int, k: int, parts: StageParts
) -> tuple[Plan, StageCost] | tuple[None, StageCost]:
    """The fastest plan whose stage cost fits; (None, the leanest cost) if none fits."""
    prof = planner.profile
    candidates: dict[tuple, Plan] = {}
    for point in planner.frontier(points=24):
        candidates.setdefault(point.plan.items, point.plan)
    least_plan, least_pred = planner.least_peak()
    candidates.setdefault(least_plan.items, finish(prof, least_plan, None, "dp")[0])
    costs = {key: stage_cost(prof, plan, k, parts) for key, plan in candidates.items()}
    # Search the single-micro-batch budget whose DP plan fills the stage's budget best.
    lo, hi = least_pred.peak_bytes, max(prof.measured_peak_bytes, least_pred.peak_bytes)
    for _ in range(_SEARCH_STEPS):
        if hi - lo <= max(1, hi // 1000):
            break
        mid = (lo + hi) // 2
        try:
            plan = planner.plan(mid)
        except BudgetError:
            lo = mid
            continue
        cost = stage_cost(prof, plan, k, parts)
        candidates.setdefault(plan.items, plan)
        costs.setdefault(plan.items, cost)
        lo, hi = (mid, hi) if cost.peak_bytes <= budget else (lo, mid)
    fitting = [key for key, cost in costs.items() if cost.peak_bytes <= budget]
    if not fitting:
        return None, min(costs.values(), key=lambda c: c.peak_bytes)
    best = min(fitting, key=lambda key: (costs[key].time_per_microbatch, costs[key].peak_bytes))
    return candidates[best], costs[best]


def _uniform(profile: Profile, k: int, parts: StageParts) -> tuple[UniformPoint, ...]:
    points = []
    for name, make in UNIFORM.items():
        cost = stage_cost(profile, make(profile), k, parts)
        points.append(UniformPoint(name, cost.peak_bytes, cost.time_per_microbatch))
    return tuple(points)


def _stage_profile(
    module: nn.Module, loss_fn: LossFn, optimizer: Any, n_microbatches: int,
    fsdp_world_size: int | None, options: dict[str, Any], together: bool | None,
) -> Profile:  # fmt: skip
    prof = options.pop("profile", None)
    if prof is None:
        if options.get("blocks") is None:  # a stage traced by pipeline(): its graph's blocks
            options["blocks"] = traced_block_paths(module)
        prof = profile_step(module, loss_fn, **options)
        if together is None:  # ranks of one pipeline: time the stages as they run, at once
            together = in_process_group() and not prof.fake
        if together:
            prof = retimed_to(prof, time_together(module, loss_fn))
    step = training_step(module, optimizer, n_microbatches, True)  # grads accumulate over M
    whole = with_training_step(prof, step)
    if fsdp_world_size is not None:
        from gradckpt.integrations.distributed import rank_memory, rank_profile

        whole = rank_profile(whole, rank_memory(module, fsdp_world_size))
    return whole


def plan_stage(
    module: nn.Module,
    inputs: Sequence[Any],
    budget: int | str,
    *,
    schedule: Any,
    stage_index: int | None = None,
    num_stages: int | None = None,
    n_microbatches: int | None = None,
    loss: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    optimizer: Any = None,
    fsdp_world_size: int | None = None,
    return_outputs: bool = True,
    segments: bool = True,
    chunking: bool = False,
    timed_together: bool | None = None,
    **profile_options: Any,
) -> StagePlan:
    """The least-recompute plan for one pipeline stage, its in-flight micro-batches held.

    Args:
        module: the stage's module (``PipelineStage.submod``), on this rank.
        inputs: one micro-batch of the stage's inputs (tokens on the first stage, the
            received activation on the others; fake or meta-free real tensors).
        budget: the device's bytes for this rank (int or a string with units), the
            whole step: every micro-batch and ``optimizer.step()``.
        schedule: a ``torch.distributed.pipelining`` schedule instance (its stage and
            micro-batch count are read from it), or its class or name with
            ``stage_index``, ``num_stages`` and ``n_microbatches``.
        loss, target: on the last stage, the schedule's ``loss_fn`` and one
            micro-batch's target.
        optimizer: the optimizer (instance, class, or name such as ``"adamw"``).
        fsdp_world_size: the stage's parameters are ``fully_shard``ed over this many
            ranks (see the module docstring).
        return_outputs: as passed to ``schedule.step`` (torch's default True): the last
            stage then keeps every micro-batch's output until the step ends.
        segments, chunking: as for :func:`gradckpt.plan`; chunking is off by default
            (the schedule, not the stage, calls the loss).
        timed_together: time the stage's plain micro-batch again with every rank timing
            its own at once, and price the plan at that rate
            (:mod:`~gradckpt.integrations.pipeline_timing`; a collective). Default: when
            a process group of several ranks is up and the profile is measured here.
        **profile_options: ``repeats``, ``fake``, ``blocks``, ``profile`` (a profile of
            this stage's micro-batch to reuse), as for :func:`gradckpt.profile`.

    Raises:
        BudgetError: no plan fits; the message names the stage, its in-flight count
            and the least peak reachable.

    Example:
        >>> sp = plan_stage(stage.submod, (x_mb,), "2GiB", schedule=schedule, optimizer="adamw")
        >>> gradckpt.apply(stage.submod, sp.plan)
    """
    if stage_index is None or num_stages is None or n_microbatches is None:
        name, stage_index, num_stages, n_microbatches = schedule_shape(schedule)
    else:
        name = schedule_name(schedule)
    if isinstance(budget, float):
        raise ValueError(
            "a pipeline stage's budget is the device's bytes (an int or '40GiB'), not a "
            "fraction: the stages' plain peaks differ, so one fraction means different bytes"
        )
    last = stage_index == num_stages - 1
    if last and loss is None:
        raise ValueError(
            f"stage {stage_index} is the last of {num_stages}: pass loss= (the schedule's "
            "loss_fn) and target= (one micro-batch's target) so its loss is planned"
        )
    k = in_flight(name, stage_index, num_stages, n_microbatches)
    loss_fn = stage_loss_fn(
        module, inputs, loss=loss if last else None, target=target, received=stage_index > 0
    )
    prof = _stage_profile(
        module, loss_fn, optimizer, n_microbatches, fsdp_world_size, dict(profile_options),
        timed_together,
    )  # fmt: skip
    seg = segments and fsdp_world_size is None
    planner = Planner(prof, segments=seg, chunking=chunking)
    nbytes = planner.budget_bytes(budget)
    out_bytes = output_bytes(module, inputs)
    received = tensor_bytes(inputs) if stage_index > 0 else 0
    parts = StageParts(
        # + one input gradient still being sent while the next is made (measured on gloo)
        buffer_bytes=n_microbatches * (received + (0 if last else out_bytes)) + received,
        output_bytes=(n_microbatches if return_outputs else k) * out_bytes if last else 0,
        merged_bytes=n_microbatches * out_bytes if last and return_outputs else 0,
    )
    plan, cost = _choose(planner, nbytes, k, parts)
    if plan is None:
        raise BudgetError(
            f"pipeline stage {stage_index} of {num_stages} ({name}, {k} micro-batches in "
            f"flight) needs at least {format_bytes(cost.peak_bytes)}, over the budget of "
            f"{format_bytes(nbytes)}: raise the budget, "
            + (
                "use Schedule1F1B (it keeps fewer micro-batches in flight), smaller "
                "micro-batches, or more stages"
                if name == "gpipe"
                else "use more micro-batches of a smaller size, or more stages"
            ),
            least_peak_bytes=cost.peak_bytes,
        )
    plain = stage_cost(prof, none_plan(prof), k, parts)
    plan = replace(plan, budget_bytes=nbytes)
    planner.release()
    return StagePlan(
        stage_index=stage_index, num_stages=num_stages, schedule=name,
        n_microbatches=n_microbatches, in_flight=k, plan=plan, budget_bytes=nbytes,
        predicted_peak_bytes=cost.peak_bytes, held_bytes=cost.held_bytes,
        buffer_bytes=parts.buffer_bytes, output_bytes=parts.output_bytes,
        merged_bytes=parts.merged_bytes,
        time_per_microbatch=cost.time_per_microbatch,
        plain_peak_bytes=plain.peak_bytes, plain_time_per_microbatch=plain.time_per_microbatch,
        uniform=_uniform(prof, k, parts), fake=prof.fake,
    )  # fmt: skip


def fit_stage(
    module: nn.Module, inputs: Sequence[Any], budget: int | str, **options: Any
) -> StagePlan:
    """:func:`plan_stage` and :func:`gradckpt.apply` on ``module``; returns the stage plan.

    Example:
        >>> sp = fit_stage(stage.submod, (x_mb,), "2GiB", schedule=schedule)
    """
    chosen = plan_stage(module, inputs, budget, **options)
    apply(module, chosen.plan)
    return chosen


def plan_stages(
    stages: Sequence[tuple[nn.Module, Sequence[Any]]],
    schedule: Any,
    budget: int | str,
    *,
    n_microbatches: int,
    loss: Callable[[Any, Any], torch.Tensor],
    target: Any = None,
    **options: Any,
) -> list[StagePlan]:
    """Every stage planned in this process (fake tensors for big models: ``fake=True``).

    Args:
        stages: ``(module, inputs)`` per stage, in pipeline order; inputs are one
            micro-batch of what the stage receives.
        schedule: a schedule class or name (``"1f1b"``, ``"gpipe"``).
        n_microbatches: micro-batches per step.
        loss, target: the schedule's loss function and one micro-batch's target.
        **options: as for :func:`plan_stage`.

    Example:
        >>> plans = plan_stages([(s0, (ids,)), (s1, (h,))], "1f1b", "40GiB", n_microbatches=8,
        ...                     loss=cross_entropy, target=y, optimizer="adamw", fake=True)
        >>> print(summary(plans))
    """
    if not stages:
        raise ValueError("plan_stages needs at least one (module, inputs) stage")
    return [
        plan_stage(
            module,
            inputs,
            budget,
            schedule=schedule,
            stage_index=i,
            num_stages=len(stages),
            n_microbatches=n_microbatches,
            loss=loss,
            target=target,
            **{"timed_together": False, **options},
        )
        for i, (module, inputs) in enumerate(stages)
    ]
