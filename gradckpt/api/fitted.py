"""The plan for the step ``loss_fn`` runs, and the model call it makes (``plan``, ``fit``).

The step is profiled within the budget (:mod:`gradckpt.api.budget`), planned,
checked on real steps where the planner is unsure (measured candidates; the
leanest plan at the edge of the budget), and its model call recorded: the shape
key that the guard and the shape planner (:mod:`gradckpt.api.shapes`) start from.

Example:
    >>> fitted, chosen, prof = plan_fitted(model, loss_fn, Budget.read("3GiB"), PlanOptions())
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import replace

import torch
from torch import nn

from gradckpt.api.budget import budget_profile, holds_beside, plan_beside
from gradckpt.api.model_calls import Call, capture_call, step_call
from gradckpt.api.options import LossFn, PlanOptions
from gradckpt.apply import guard as shape_guard
from gradckpt.apply.apply import install_plan
from gradckpt.apply.real_shape import step_peak
from gradckpt.measure.beside import malloc_in_use, warn_tensors_only
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import Plan, Segment
from gradckpt.planning.plans.planset import shape_key
from gradckpt.planning.solving.budget import Budget, BudgetError
from gradckpt.planning.solving.whole_step import with_training_step
from gradckpt.profiling import adapters
from gradckpt.profiling.fake import fake_model
from gradckpt.profiling.records import Profile

__all__ = ["EDGE_SHARE", "for_the_running_call", "plan_fitted"]


def plan_fitted(
    model: nn.Module,
    loss_fn: LossFn,
    budget: Budget,
    options: PlanOptions,
    measure_candidates: int = 0,
) -> tuple[Call | None, Plan, Profile]:
    """The plan for ``loss_fn``'s step, the model call it makes (its shape key), its profile.

    The call is seen while the step runs (profiling, or measuring candidates);
    with a given profile and nothing measured, under fake tensors. None for the
    call: the step never calls the model's own forward, so there is no shape to guard.

    Example:
        >>> call, plan, prof = plan_fitted(model, loss_fn, Budget.read(0.5), PlanOptions())
    """
    # What planning then holds is counted with the steps it checks, at malloc's level;
    # not with offload: on the CPU the host memory it moves tensors to is malloc's too.
    at_malloc = options.offload is None
    gc.collect()  # the caller's garbage is not planning's
    since = malloc_in_use() if at_malloc else None
    recording = capture_call(model, loss_fn)
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
        reserved = holds_beside(budget, at_malloc)
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
    fitted = replace(step_call(calls), profile=prof, plan=chosen) if calls else None
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
            calls.append(Call(args, dict(kwargs), shape_key(args, kwargs)))
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
