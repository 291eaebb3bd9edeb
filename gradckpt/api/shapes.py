"""The shape side of the API: plans for shapes other than the fitted one, and the guard
that switches between them (``gradckpt.plan(shapes=...)``, ``gradckpt.fit``).

``plan`` and ``fit`` (:mod:`gradckpt.api.verbs`, :mod:`gradckpt.api.fitting`) check
arguments and call these; the plan at the fitted shape is :mod:`gradckpt.api.fitted`'s.

Example:
    >>> planner = shape_planner(model, fitted, chosen.budget_bytes, options, ShapeOptions())
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from gradckpt.api.model_calls import Call, LossFrom, step_at, step_call
from gradckpt.api.options import LossFn, PlanOptions, ShapeOptions
from gradckpt.api.shape_planner import ShapePlanner
from gradckpt.apply import guard as shape_guard
from gradckpt.apply.apply import install_plan
from gradckpt.apply.real_shape import (
    TRUSTED_UNSEEN_SHARE,
    measured_at_shape,
    step_peak,
    unseen_share,
    verified_at_shape,
)
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.calls import as_called
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.plans.planset import ShapeKey, shape_key
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.baselines import every_kth_plan, none_plan
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.rescale import with_measured_workspace
from gradckpt.planning.solving.whole_step import with_training_step
from gradckpt.profiling.records import Profile
from gradckpt.profiling.run import profile as profile_step
from gradckpt.profiling.training_step import TrainingStep

__all__ = ["TAIL_RESERVE", "plan_shape", "routed_guard", "shape_planner"]


#: Kept back beside the step's tail at a new shape (a share of the tail): the tail is
#: measured at the fitted shape and scaled with the activations, and that is an
#: estimate (on a DPO step planned at 103 tokens, it missed 32 KiB of a 1.06 MiB tail
#: at 106 tokens, which ran 70 KiB over the budget).
TAIL_RESERVE = 0.1


def shape_planner(
    model: nn.Module,
    fitted: Call,
    budget_bytes: int | None,
    options: PlanOptions,
    shapes: ShapeOptions,
) -> ShapePlanner:
    """Plans other shapes of ``fitted``'s call under the same budget in bytes (fake profiles).

    Example:
        >>> planner = shape_planner(model, call, plan.budget_bytes, PlanOptions(), ShapeOptions())
    """
    assert budget_bytes is not None
    loss_from = shapes.loss_from
    if loss_from is not None:
        _check_loss_from(loss_from, fitted)

    def profile_fake(step: LossFn) -> Profile:
        return profile_step(model, step, blocks=options.blocks, fake=True)

    def planner_for(prof: Profile) -> Planner:
        whole = with_training_step(with_measured_workspace(prof, fitted.profile), options.step)
        return Planner(
            whole, segments=options.segments, offload=options.offload, chunking=options.chunking
        )

    tail: list[tuple[int, int]] = []  # (bytes, plain activations) of the replay at the fitted call

    def step_tail(prof: Profile) -> int:
        """What the step keeps beyond the replay profiled as ``prof`` (see :func:`_step_tail`)."""
        if not tail:
            tail.append(_step_tail(model, fitted, loss_from, profile_fake, planner_for))
        extra, at_fitted = tail[0]
        if not extra:
            return 0
        # scaled with the step's activations, never below what the fitted shape needed
        grown = max(1.0, (prof.measured_peak_bytes - prof.param_bytes) / max(1, at_fitted))
        return math.ceil(extra * grown * (1 + TAIL_RESERVE))

    def solve_profile(prof: Profile) -> Plan:
        extra = step_tail(prof)
        plan = planner_for(prof).plan(budget_bytes - extra, options.solver)
        if not extra:
            return plan
        parts = plan.step
        if parts is not None and parts.phase != "optimizer step":  # the tail is activations
            parts = replace(parts, activations=parts.activations + extra)
        return replace(
            plan, budget_bytes=budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes + extra,
            step=parts,
        )  # fmt: skip

    def verify_real(call: Call, prof: Profile) -> Plan | None:
        step = step_at(model, call, loss_from)
        return verified_at_shape(
            model, step, lambda: planner_for(prof), budget_bytes, fitted.profile, options.solver
        )

    # The fitted profile held memory its tensors do not show (convolution workspace):
    # a fake profile at another shape misses it too, so each plan made from one is
    # checked by one real step at its shape (the cost: that step, once per new shape).
    unseen = unseen_share(fitted.profile) > TRUSTED_UNSEEN_SHARE

    leanest: list[Plan] = []  # made at the first real re-plan, from the fitted profile

    def measure_real(call: Call) -> Plan:
        if fitted.profile is None:
            raise RuntimeError("no fitted profile to take the leanest plan from")
        if not leanest:
            planner = Planner(
                fitted.profile, segments=options.segments, offload=options.offload,
                chunking=options.chunking,
            )  # fmt: skip
            leanest.append(planner.least_peak()[0])
        step = step_at(model, call, loss_from)
        return measured_at_shape(model, step, leanest[0], budget_bytes, fitted.profile)

    made = ShapePlanner(
        model, fitted, loss_from, profile_fake, solve_profile, seq_dim=shapes.seq_dim,
        rescale=shapes.rescale,
        measure_real=measure_real, verify_real=verify_real if unseen else None,
    )  # fmt: skip
    made.step_tail = step_tail
    return made


def _check_loss_from(loss_from: LossFrom, fitted: Call) -> None:
    """``loss_from`` takes the model's output and the model call's own arguments: now, not
    at the first new shape (where a mismatch would only leave the old plan running)."""
    try:
        signature = inspect.signature(loss_from)
    except (TypeError, ValueError):  # no signature to read (a builtin): called as it is
        return
    try:
        signature.bind(None, *fitted.args, **fitted.kwargs)
    except TypeError as exc:
        given = ", ".join(
            [f"{len(fitted.args)} positional"] + [f"{k}=" for k in fitted.kwargs]
        )
        raise TypeError(
            f"gradckpt: loss_from= is called as loss_from(output, *args, **kwargs) with the "
            f"model call's own arguments ({given}), and {exc}; e.g. "
            "loss_from=lambda output, *args, **kwargs: <the loss>"
        ) from None


def _step_tail(
    model: nn.Module,
    fitted: Call,
    loss_from: LossFrom | None,
    profile_fake: Callable[[LossFn], Profile],
    planner_for: Callable[[Profile], Planner],
) -> tuple[int, int]:
    """What the fitted step keeps beyond its model calls and ``loss_from``, and the replay's
    plain activations: a new shape is planned from a replay of the model calls alone.

    A trainer's step does more than call the model (a DPO step runs a reference model
    beside it and its own loss on per-token log-probabilities; a user's loss keeps
    log-softmax temporaries a sum of the logits does not): the fitted step's predicted
    peak less the replay's at the same shape, the most over the fitted plan, the plain
    plan and every block recomputed (what the step keeps beside the model matters where
    a plan peaks, and the plan for a new shape peaks where its budget drives it). (0, 0)
    when unknown (no fitted profile, or the replay cannot run under fake tensors).
    """
    if fitted.profile is None or fitted.plan is None:
        return 0, 0
    try:
        replay = planner_for(profile_fake(step_at(model, fitted, loss_from))).profile
        missed = 0
        for plan in (fitted.plan, none_plan(fitted.profile), every_kth_plan(fitted.profile, 1)):
            ran = as_called(plan, [u.path for u in replay.units]) or plan
            gap = simulate(fitted.profile, plan).peak_bytes - simulate(replay, ran).peak_bytes
            missed = max(missed, gap)
    except Exception:  # the replay needs what fake tensors cannot do: no correction
        return 0, 0
    return missed, replay.measured_peak_bytes - replay.param_bytes


def plan_shape(planner: Callable[[Call], Plan], call: Call) -> Plan:
    """``planner(call)``; a budget that does not fit says at which shape.

    Example:
        >>> plan_shape(planner, call).input_shapes
    """
    try:
        return planner(call)
    except BudgetError as exc:
        raise BudgetError(
            f"at input shape {call.key.describe()}: {exc}", exc.least_peak_bytes
        ) from exc


def routed_guard(
    model: nn.Module,
    plans: dict[ShapeKey | None, Plan],
    active: ShapeKey,
    planner: ShapePlanner,
    shapes: ShapeOptions,
    step: TrainingStep | None = None,
) -> shape_guard.ShapeGuard:
    """The shape guard ``fit`` installs: checks each call, switches or plans per shape.

    Example:
        >>> install_guarded(model, plan, routed_guard(model, plans, key, planner, ShapeOptions()))
    """

    def step_of(inputs: list[tuple[tuple, dict[str, Any]]]) -> Call:
        return step_call([Call(a, k, shape_key(a, k)) for a, k in inputs])

    def plan_new(inputs: list[tuple[tuple, dict[str, Any]]]) -> Plan:
        return planner(step_of(inputs))

    def predict(chosen: Plan, inputs: list[tuple[tuple, dict[str, Any]]]) -> int:
        call = step_of(inputs)
        planner.routes.setdefault(call.key, "old-plan")
        return _predicted_or_measured(model, planner, chosen, call, step)

    made = _RoutedGuard(
        shapes.on_new_shape,
        plans,
        active,
        lambda p: install_plan(model, p),
        planner=plan_new,
        predictor=predict,
        round_up=shapes.round_up,
        rescaled=lambda: planner.rescaled,
        routes=lambda: planner.routes,
    )
    planner.current = lambda: made.plans.get(made.active)
    return made


@dataclass(eq=False)
class _RoutedGuard(shape_guard.ShapeGuard):
    """The guard ``fit`` installs: its stats also say how each shape got its plan."""

    routes: Callable[[], dict[ShapeKey, str]] = field(default=dict)

    def stats(self) -> shape_guard.ShapeStats:
        routes = tuple((k.describe(), r) for k, r in self.routes().items())
        return replace(super().stats(), routes=routes)


def _predicted_or_measured(
    model: nn.Module, planner: ShapePlanner, chosen: Plan, call: Call,
    step: TrainingStep | None,
) -> int:  # fmt: skip
    """``chosen``'s peak at ``call``: simulated on a fake profile, else measured on one real
    step under it (what the caller's step runs next anyway), else its peak where it was made."""
    try:
        prof = with_measured_workspace(planner.profile_call(call), planner.fitted.profile)
        ran = as_called(chosen, [u.path for u in prof.units])  # as the engine runs it there
        if ran is None:
            raise ValueError("a plan with segments run at another number of calls per step")
        return simulate(with_training_step(prof, step), ran).peak_bytes + planner.step_tail(prof)
    except Exception as exc:  # the step cannot run under fake tensors
        fake_failed = type(exc).__name__  # not exc: its traceback holds real tensors
    fitted = planner.fitted.profile
    try:
        if fitted is None:
            raise RuntimeError("no fitted profile")
        measured = step_peak(model, step_at(model, call, planner.loss_from), chosen)
        pred = simulate(fitted, chosen)
        return fitted.param_bytes + measured + max(0, pred.peak_bytes - pred.fwd_bwd_peak_bytes)
    except Exception as exc:
        warnings.warn(
            f"gradckpt: the peak at {call.key.describe()} could not be predicted (fake tensors: "
            f"{fake_failed}; a real step: {type(exc).__name__}: {exc}); the "
            "figure below is the plan's predicted peak at the shape it was made for",
            stacklevel=6,
        )
        return chosen.predicted_peak_bytes
