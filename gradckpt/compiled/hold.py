"""``fit(..., compile=True)`` holds its byte budget where the compiled step allocates.

A plan is made from the *eager* profile; the compiled graph runs it with other
memory. Where a backend decomposes GELU-tanh (``aot_eager_decomp_partition``,
inductor), a unit recomputed inside the compiled backward keeps intermediates
of its recomputed forward that the decomposed GELU backward reads: four
(B, T, 4C) tensors unfused (x*x, x/2, tanh, 1+tanh), one under inductor's fusion
(tanh), where eager's ``gelu_backward`` reads its input only. Measured on the
4-layer GPT of ``gradckpt.testing`` (d=64, T=32, batch 4, every block
recomputed, ``aot_eager_decomp_partition``): 0.29 MB (dropout 0.1) and 0.39 MB
(no dropout) above the same plan eagerly, at the allocator; without
decompositions (``aot_eager``) or with ReLU, no higher than eager
(tests/compiled/test_hold.py). A fit at 0.6 of the plain peak measured
3.31 MB compiled against a 2.99 MB budget. The tags cannot change what the
backend's backward formulas read. So the prediction cannot be trusted
and :func:`hold_budget` *measures*: one compiled training step under
:class:`~gradckpt.measure.AllocatorTracker`; over the budget, it plans again for
a budget shrunk by the plan's miss (``budget * predicted / measured``),
recompiles and measures again, a few tries at most. If none fits it raises
:class:`~gradckpt.planning.solving.budget.BudgetError` naming the least measured peak,
and the caller restores the model. The plan that holds records its measured
peak (``Plan.measured_compiled_peak_bytes``). Plans made again are the
planner's for the tighter budget (not measured for speed, as ``fit``'s first
candidates are).

Cost: per try one compile and three compiled steps (compile, warm, measured).

Example:
    >>> plan = hold_budget(model, loss_fn, plan, replan=..., install=...)
    >>> plan.measured_compiled_peak_bytes <= plan.budget_bytes
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gradckpt.apply.apply import remove
from gradckpt.apply.measured_step import PlanSteps
from gradckpt.compiled.in_graph import compile as compile_planned
from gradckpt.compiled.in_graph import restamp_compiled, uncompile
from gradckpt.compiled.watch import unwatch
from gradckpt.measure import format_bytes, state_bytes
from gradckpt.planning.planner import Planner
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.solvers import Solver

__all__ = ["MAX_COMPILES", "compile_within_budget", "compiled_step_peak", "hold_budget"]

#: Plans compiled and measured at most (the first included): each costs a compile.
MAX_COMPILES = 3
#: Solves at most: a tighter budget can give a plan already measured (no compile then).
_MAX_SOLVES = 8


def compiled_step_peak(model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> int:
    """Parameters and buffers plus the allocator bytes one compiled training step adds.

    Runs three steps (the first compiles forward and backward, the second warms,
    the third is measured); gradients, buffers and the RNG are left as found.

    Example:
        >>> gradckpt.compile(model, loss_fn); compiled_step_peak(model, loss_fn)
    """
    # Not watching modules: Dynamo would trace its global module hook into the step
    # (a graph break, and a recompile once the hook is gone). The plan is compiled in.
    with PlanSteps(model, loss_fn, prepared=False, watch_modules=False) as steps:
        for _ in range(2):
            steps.run(None, measure=False)
        _, measured = steps.run(None)
    assert measured is not None
    return state_bytes(model) + measured.peak_bytes


def hold_budget(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    plan: Plan,
    *,
    replan: Callable[[int], Plan],
    install: Callable[[Plan], None],
) -> Plan:
    """The plan (installed and compiled) whose measured compiled peak fits ``plan.budget_bytes``.

    Args:
        model, loss_fn: the model with ``plan`` installed and compiled, its step.
        plan: the eager plan; its ``budget_bytes`` is the budget held.
        replan: a plan for a tighter budget in bytes (raises BudgetError when
            nothing fits it).
        install: puts a plan on the model and compiles it.

    Returns:
        The plan installed, with ``measured_compiled_peak_bytes`` set;
        ``budget_bytes`` stays the caller's budget.

    Raises:
        BudgetError: no plan tried measured within the budget (the model is
            left with the last one installed: the caller restores it).

    Example:
        >>> hold_budget(model, loss_fn, plan, replan=lambda b: planner.plan(b), install=put)
    """
    budget = plan.budget_bytes
    if budget is None:  # nothing to hold
        return replace(plan, measured_compiled_peak_bytes=compiled_step_peak(model, loss_fn))
    measured: dict[tuple, int] = {}
    current, target = plan, budget
    for _ in range(_MAX_SOLVES):
        peak = measured.get(current.items)
        if peak is None:
            if len(measured) == MAX_COMPILES:
                break
            if measured:  # the first plan is installed and compiled by the caller
                install(current)
            peak = measured[current.items] = compiled_step_peak(model, loss_fn)
        if peak <= budget:
            return replace(current, budget_bytes=budget, measured_compiled_peak_bytes=peak)
        # Aim the eager prediction lower by the share this plan's compiled step
        # exceeded its prediction by; below what any plan reaches, try the leanest once.
        target = min(target - 1, budget * current.predicted_peak_bytes // peak)
        try:
            current = replan(target)
        except BudgetError as missed:
            least = missed.least_peak_bytes
            if least is None or least <= target or least >= current.predicted_peak_bytes:
                break
            target = least
            try:
                current = replan(target)
            except BudgetError:
                break
    least = min(measured.values())
    raise BudgetError(
        f"gradckpt.fit(compile=True): no plan held the budget of {format_bytes(budget)} "
        f"({budget} bytes) once compiled: {len(measured)} plan(s) compiled and measured at "
        f"the allocator, the least peaking at {format_bytes(least)} ({least} bytes). The "
        "model is left as it was. gradckpt.compiled.budget.fit_compiled "
        "measures every compiled candidate (the compiler's own partitioner too) and picks "
        "the fastest under a budget; or raise the budget, or run the plan eagerly "
        "(compile=False), where the planned peak holds."
    )


def compile_within_budget(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    plan: Plan,
    planner: Planner,
    solver: str | Solver,
    put: Callable[[Plan], None],
    **compile_kwargs: Any,
) -> Plan:
    """Compile ``model`` (``plan`` installed eagerly) and hold ``plan.budget_bytes`` measured.

    Args:
        planner, solver: what made ``plan``; tighter budgets are solved with them.
        put: installs a plan eagerly (``fit``'s way: with its shape guard).
        **compile_kwargs: for :func:`gradckpt.compile`.

    Returns:
        The plan compiled into ``model``, its measured compiled peak recorded.

    Raises:
        BudgetError: none fits once compiled; ``model`` is then plain again
            (no plan, not compiled), as before ``fit``.

    Example:
        >>> plan = compile_within_budget(model, loss_fn, plan, planner, "dp", put)
    """

    def install(chosen: Plan) -> None:
        uncompile(model)
        unwatch(model)  # compile_stats count the compile the model keeps
        # Dynamo's caches hold the frames traced with the plan given up; without a
        # reset the new plan's trace is a "recompile" of them (warned, and counted
        # towards recompile_limit). Global, like fit_compiled's: other compiled
        # models compile again at their next call.
        torch._dynamo.reset()
        put(chosen)
        compile_planned(model, loss_fn, **compile_kwargs)

    try:
        compile_planned(model, loss_fn, **compile_kwargs)
        held = hold_budget(
            model, loss_fn, plan, replan=lambda budget: planner.plan(budget, solver), install=install
        )
    except BaseException:
        uncompile(model)
        unwatch(model)
        remove(model)
        raise
    restamp_compiled(model, held)
    return held
