"""The shape side of the API: the plan for the step's own call, plans for other shapes,
and the guard that switches between them (``gradckpt.plan(shapes=...)``, ``gradckpt.fit``).

Split out of :mod:`gradckpt.api` (same layer): the verbs there check arguments
and call these.

Example:
    >>> fitted, chosen, prof = plan_fitted(model, loss_fn, "3GiB", options)
    >>> planner = shape_planner(model, fitted, chosen.budget_bytes, options)
"""

from __future__ import annotations

import gc
import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from gradckpt import replan
from gradckpt.api_budget import budget_profile, plan_beside
from gradckpt.apply import guard as shape_guard
from gradckpt.apply.apply import install_plan
from gradckpt.apply.real_shape import (
    TRUSTED_UNSEEN_SHARE,
    measured_at_shape,
    step_peak,
    unseen_share,
    verified_at_shape,
)
from gradckpt.measure.beside import malloc_in_use, warn_tensors_only
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.calls import as_called
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.plan import Plan, Segment
from gradckpt.planning.plans.planset import ShapeKey
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.baselines import every_kth_plan, none_plan
from gradckpt.planning.solving.budget import BudgetError, read_budget
from gradckpt.planning.solving.rescale import with_measured_workspace
from gradckpt.planning.solving.solvers import Solver
from gradckpt.planning.solving.whole_step import with_training_step
from gradckpt.profiling import adapters
from gradckpt.profiling.fake import fake_model
from gradckpt.profiling.records import Profile
from gradckpt.profiling.run import profile as profile_step
from gradckpt.profiling.training_step import TrainingStep
from gradckpt.profiling.units import BlockSpec

__all__ = ["PlanOptions", "ShapeHandling", "guard", "plan_fitted", "plan_shape", "shape_planner"]

LossFn = Callable[[], torch.Tensor]

#: Kept back beside the step's tail at a new shape (a share of the tail): the tail is
#: measured at the fitted shape and scaled with the activations, and that is an
#: estimate (on a DPO step planned at 103 tokens, it missed 32 KiB of a 1.06 MiB tail
#: at 106 tokens, which ran 70 KiB over the budget).
TAIL_RESERVE = 0.1


@dataclass(frozen=True)
class PlanOptions:
    """The planning options ``plan`` and ``fit`` share (already checked)."""

    blocks: BlockSpec = None
    solver: str | Solver = "dp"
    repeats: int = 3
    profile: Profile | None = None
    segments: bool = True
    offload: OffloadOptions | None = None
    #: The training step around forward/backward that the budget also holds.
    step: TrainingStep | None = None
    #: Gradients and optimizer state that exist already (beside a real profile's step).
    held_bytes: int = 0
    #: Whether plans may chunk the head and its loss (``Chunk``); False: bit for bit plain.
    chunking: bool = True


@dataclass(frozen=True)
class ShapeHandling:
    """What ``fit`` does with calls at shapes other than the fitted one (its shape options,
    checked): they travel together from ``fit``/``plan`` to the shape planner and the guard."""

    on_new_shape: str = "replan"
    loss_from: replan.LossFrom | None = None
    round_up: bool = False
    seq_dim: int = 1
    rescale: bool = True


def plan_fitted(
    model: nn.Module,
    loss_fn: LossFn,
    budget: int | float | str,
    options: PlanOptions,
    measure_candidates: int = 0,
) -> tuple[replan.Call | None, Plan, Profile]:
    """The plan for ``loss_fn``'s step, the model call it makes (its shape key), its profile.

    The call is seen while the step runs (profiling, or measuring candidates);
    with a given profile and nothing measured, under fake tensors. None for the
    call: the step never calls the model's own forward, so there is no shape to guard.

    Example:
        >>> call, plan, prof = plan_fitted(model, loss_fn, 0.5, PlanOptions())
    """
    # What planning then holds is counted with the steps it checks, at malloc's level;
    # not with offload: on the CPU the host memory it moves tensors to is malloc's too.
    at_malloc = options.offload is None
    gc.collect()  # the caller's garbage is not planning's
    since = malloc_in_use() if at_malloc else None
    recording = replan.capture_call(model, loss_fn)
    given = options.profile
    raw_fake = None  # set when the plain step may not fit: planned from fake tensors
    if given is None:
        prof, raw_fake = budget_profile(
            model, recording, budget, options.step, blocks=options.blocks,
            repeats=options.repeats, held_bytes=options.held_bytes,
        )  # fmt: skip
    else:
        prof = with_training_step(given, options.step)
    calls = recording.calls  # type: ignore[attr-defined]
    segments = options.segments
    if given is None and not calls:
        # The step never runs the model's own forward (a trainer calling its parts):
        # a segment opens only inside that forward, so plan unit by unit.
        segments = False
    planner = Planner(prof, segments=segments, offload=options.offload, chunking=options.chunking)
    budget_bytes = planner.budget_bytes(budget)
    try:
        chosen = plan_beside(planner, budget, budget_bytes, options.solver, since, at_malloc)
    except BudgetError as beside_refused:
        chosen, refused = None, beside_refused
        reserved = at_malloc and read_budget(budget)[0] != "fraction"
        if reserved:  # the tensors may fit where they and what is beside them do not
            try:
                chosen = planner.plan(budget_bytes, options.solver)
            except BudgetError as exc:
                refused = exc
        if chosen is None:  # just under the least predicted peak: the real step decides
            with shape_guard.paused(model):
                chosen = _leanest_if_it_fits(model, recording, planner, budget_bytes, refused)
            raw_fake, measure_candidates = None, 0  # measured: nothing leaner to choose from
        if reserved:
            warn_tensors_only(budget_bytes, beside_refused.least_peak_bytes, stacklevel=4)
        at_malloc, since = False, None  # the budget now holds the tensors only
        # A refusal's traceback holds planning's frames (its DP tables: CPU tensors) in a
        # cycle with this one; not kept while the steps run.
        refused = None
    measured = measure_candidates and not prof.fake
    if raw_fake is not None:  # checked on real steps under plans that fit, never the plain one
        from gradckpt.apply.frugal import frugal_measured

        with shape_guard.paused(model):
            chosen = frugal_measured(model, recording, planner, raw_fake, chosen, budget_bytes,
                                     max(1, measure_candidates), rounds=3 if measure_candidates else 1,
                                     solver=options.solver, since=since,
                                     at_malloc=at_malloc)  # fmt: skip
        measured = True
    elif measured:
        from gradckpt.apply.select import fastest_measured

        count = measure_candidates if options.solver == "dp" else 1
        with shape_guard.paused(model):  # candidates are applied and run by hand
            chosen = fastest_measured(model, recording, planner, chosen, count)
    if not calls and given is not None and not measured:  # nothing ran for real yet
        _see_call(model, recording)
        if not calls and segments and any(isinstance(i, Segment) for i in chosen.items):
            # Known only now that the forward is never called: its segments would not open.
            chosen = plan_beside(
                Planner(prof, segments=False, offload=options.offload, chunking=options.chunking),
                budget, budget_bytes, options.solver, since, at_malloc,
            )  # fmt: skip
    chosen = replace(chosen, budget_bytes=budget_bytes)
    fitted = replace(replan.step_call(calls), profile=prof, plan=chosen) if calls else None
    return fitted, chosen, prof


class _Seen(Exception):
    """Raised by the hook that saw the model's call: nothing after it needs to run."""


def _see_call(model: nn.Module, recording: LossFn) -> None:
    """Run ``recording`` under fake tensors only up to the model's call (its shapes).

    The model's forward and the loss after it never run, so neither the user's
    hooks nor a ``loss.item()`` in ``loss_fn`` meet a fake tensor; a step that
    fails before it calls the model is seen as not calling it.
    """

    calls = recording.calls  # type: ignore[attr-defined]

    def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not calls:  # this hook runs before the one recording() registers
            calls.append(replan.Call(args, dict(kwargs), replan.shape_key(args, kwargs)))
        raise _Seen

    preparing = adapters.preparing(model, fake=True)
    with preparing, torch.no_grad(), fake_model(model) as mode, mode:
        handle = model.register_forward_pre_hook(stop, with_kwargs=True, prepend=True)
        try:
            recording()
        except Exception:  # _Seen, or a step that failed before the call: shapes only
            pass
        finally:
            handle.remove()


def shape_planner(
    model: nn.Module,
    fitted: replan.Call,
    budget_bytes: int | None,
    options: PlanOptions,
    shapes: ShapeHandling,
) -> replan.ShapePlanner:
    """Plans other shapes of ``fitted``'s call under the same budget in bytes (fake profiles).

    Example:
        >>> planner = shape_planner(model, call, plan.budget_bytes, PlanOptions(), ShapeHandling())
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

    def verify_real(call: replan.Call, prof: Profile) -> Plan | None:
        step = replan.step_at(model, call, loss_from)
        return verified_at_shape(
            model, step, lambda: planner_for(prof), budget_bytes, fitted.profile, options.solver
        )

    # The fitted profile held memory its tensors do not show (convolution workspace):
    # a fake profile at another shape misses it too, so each plan made from one is
    # checked by one real step at its shape (the cost: that step, once per new shape).
    unseen = unseen_share(fitted.profile) > TRUSTED_UNSEEN_SHARE

    leanest: list[Plan] = []  # made at the first real re-plan, from the fitted profile

    def measure_real(call: replan.Call) -> Plan:
        if fitted.profile is None:
            raise RuntimeError("no fitted profile to take the leanest plan from")
        if not leanest:
            planner = Planner(
                fitted.profile, segments=options.segments, offload=options.offload,
                chunking=options.chunking,
            )  # fmt: skip
            leanest.append(planner.least_peak()[0])
        step = replan.step_at(model, call, loss_from)
        return measured_at_shape(model, step, leanest[0], budget_bytes, fitted.profile)

    made = replan.ShapePlanner(
        model, fitted, loss_from, profile_fake, solve_profile, seq_dim=shapes.seq_dim,
        rescale=shapes.rescale,
        measure_real=measure_real, verify_real=verify_real if unseen else None,
    )  # fmt: skip
    made.step_tail = step_tail
    return made


#: A budget at most this share below the least predicted peak is tried on a real step
#: under the leanest plan: the simulator can count a small gradient (one bias, a few
#: hundred bytes) before a free at the same op that the allocator sees first, so a
#: budget at exactly what torch's every-block checkpointing reaches was refused.
EDGE_SHARE = 1e-3


def _leanest_if_it_fits(
    model: nn.Module, step: LossFn, planner: Planner, budget: int, refused: BudgetError
) -> Plan:
    """The leanest plan when one real step under it fits ``budget`` at the allocator;
    ``refused`` (the planner's error) when the budget is further below or the step does not fit."""
    least = refused.least_peak_bytes
    if least is None or least > budget * (1 + EDGE_SHARE):
        raise refused
    leanest, pred = planner.least_peak()
    planner.release()
    prof = planner.profile
    held = prof.param_bytes + prof.resident_bytes  # resident through forward and backward
    beyond = max(0, pred.peak_bytes - pred.fwd_bwd_peak_bytes)  # the optimizer step's part
    whole = held + step_peak(model, step, leanest) + beyond
    if whole > budget:
        raise refused
    return replace(leanest, budget_bytes=budget, predicted_peak_bytes=whole, peak_level="allocator")


def _check_loss_from(loss_from: replan.LossFrom, fitted: replan.Call) -> None:
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
    fitted: replan.Call,
    loss_from: replan.LossFrom | None,
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
        replay = planner_for(profile_fake(replan.step_at(model, fitted, loss_from))).profile
        missed = 0
        for plan in (fitted.plan, none_plan(fitted.profile), every_kth_plan(fitted.profile, 1)):
            ran = as_called(plan, [u.path for u in replay.units]) or plan
            gap = simulate(fitted.profile, plan).peak_bytes - simulate(replay, ran).peak_bytes
            missed = max(missed, gap)
    except Exception:  # the replay needs what fake tensors cannot do: no correction
        return 0, 0
    return missed, replay.measured_peak_bytes - replay.param_bytes


def for_the_running_call(
    model: nn.Module, chosen: Plan, prof: Profile, options: PlanOptions,
    guard_: shape_guard.ShapeGuard,
) -> None:  # fmt: skip
    """``fit`` ran inside the model's own call: give that call a plan it can run.

    The call began before ``fit`` installed the root wrapper, so a segment of
    ``chosen`` would not open in it (its units would keep what the segment
    drops). Until the step ends the model runs the plan without segments made for
    the same budget; ``chosen`` takes over at the next step's first call. When
    no plan without segments fits, the running call keeps ``chosen`` with a
    warning naming what it cannot hold.

    Example:
        >>> for_the_running_call(model, plan, prof, PlanOptions(), guard)
    """
    if not any(isinstance(item, Segment) for item in chosen.items):
        return
    assert chosen.budget_bytes is not None
    try:
        # The DP's plan: a segment baseline (sqrt) has no form without segments.
        interim = Planner(
            prof, segments=False, offload=options.offload, chunking=options.chunking
        ).plan(
            chosen.budget_bytes, "dp"
        )
    except BudgetError as exc:
        warnings.warn(
            "gradckpt: fit ran inside the model's own call, which began before the plan "
            "was installed: its segments do not open in this call, and no plan without "
            f"segments fits the budget ({exc.least_peak_bytes} bytes at the least), so this "
            "call may run over it; the next steps run the plan.",
            stacklevel=3,
        )
        return
    install_plan(model, interim)
    guard_.interim = True


def plan_shape(planner: Callable[[replan.Call], Plan], call: replan.Call) -> Plan:
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


def guard(
    model: nn.Module,
    plans: dict[ShapeKey | None, Plan],
    active: ShapeKey,
    planner: replan.ShapePlanner,
    shapes: ShapeHandling,
    step: TrainingStep | None = None,
) -> shape_guard.ShapeGuard:
    """The shape guard ``fit`` installs: checks each call, switches or plans per shape.

    Example:
        >>> install_guarded(model, plan, guard(model, plans, key, planner, ShapeHandling()))
    """

    def step_of(inputs: list[tuple[tuple, dict[str, Any]]]) -> replan.Call:
        return replan.step_call([replan.Call(a, k, replan.shape_key(a, k)) for a, k in inputs])

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
    model: nn.Module, planner: replan.ShapePlanner, chosen: Plan, call: replan.Call,
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
        measured = step_peak(model, replan.step_at(model, call, planner.loss_from), chosen)
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
