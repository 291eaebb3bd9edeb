"""A byte budget for the compiled step, held where the compiled code allocates: at the allocator.

A plan made from the eager profile predicts eager memory; the compiled step
saves what the partitioner chose, fuses pointwise ops away and allocates
outside the dispatcher. So :func:`fit_compiled` does not trust predictions:
it compiles a handful of candidates and *measures* each compiled step's
allocator peak and median time:

* gradckpt plans (segments allowed) at several fractions of the eager peak, each
  executed by the compiler (:func:`gradckpt.compiled.in_graph.compile`);
* the same from the *fused view* of the profile (:func:`fused_profile`): ops
  without FLOPs cost no time, as when the compiler fuses them into their
  neighbours, so the solver prefers plans that recompute pointwise ops and
  keep the matmuls (what the compiler's own partitioner does);
* the compiler's own partitioner at ``activation_memory_budget`` values
  (1.0 is ``torch.compile``'s default);
* the compiler's partitioner held to a cap in saved bytes, a fraction of what
  its default saves, chosen on the compiled graph by gradckpt's knapsack
  solver (:mod:`gradckpt.compiled.knapsack`).

It then installs the fastest candidate whose measured peak fits the budget.
Choosing from one measured table makes the result monotone: a larger budget
admits a superset of candidates, so the chosen peak never shrinks below a
smaller budget's choice and never exceeds the budget (the compiler's own knob
is not monotone, pytorch#197838). Dynamo's caches are reset between
candidates (each is a fresh compile of the same code).

Peak here is the allocator bytes one training step adds (forward, backward,
gradients; parameters existed before), on CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from gradckpt.apply.apply import apply, remove
from gradckpt.compiled.hold import compiled_step_peak
from gradckpt.compiled.in_graph import compile as compile_planned
from gradckpt.compiled.in_graph import uncompile
from gradckpt.compiled.knapsack import SavedBytesSolver, saved_bytes_config
from gradckpt.planning import Plan
from gradckpt.planning.kinds.chunk.handler import allow_chunking
from gradckpt.planning.solve import solve
from gradckpt.planning.solving.budget import BudgetError, parse_budget
from gradckpt.profiling import profile as make_profile
from gradckpt.profiling.records import Profile, retimed

__all__ = [
    "CompiledFit",
    "CompiledPoint",
    "choose",
    "fit_compiled",
    "fused_profile",
    "install",
    "measure_points",
]

LossFn = Callable[[], torch.Tensor]
# fit_compiled's options that shape the candidate set (the rest go to torch.compile).
_CANDIDATE_OPTIONS = (
    "plan_fractions", "fused_fractions", "compiler_budgets", "saved_fractions", "repeats"
)  # fmt: skip


@dataclass(frozen=True)
class CompiledPoint:
    """One compiled way to run the step, measured: its allocator peak and median step time."""

    label: str
    plan: Plan | None  # gradckpt's plan run by the compiler; None for the compiler's own
    compiler_budget: float | None  # activation_memory_budget; None for gradckpt points
    peak_bytes: int
    step_time: float  # seconds, median
    # SavedBytesSolver's cap (a fraction of the default's saved bytes); None otherwise
    saved_fraction: float | None = None


@dataclass(frozen=True)
class CompiledFit:
    """What :func:`fit_compiled` measured and which point it installed."""

    budget_bytes: int
    chosen: CompiledPoint
    points: tuple[CompiledPoint, ...]


def fused_profile(profile: Profile) -> Profile:
    """``profile`` with every op that does no FLOPs costing no time (the compiler fuses them).

    Why: the eager profile charges recomputing a norm or an activation its
    eager, memory-bound time; in a compiled backward it is fused into a
    neighbouring kernel and nearly free. Measured on Llama (4 layers, d=128):
    at about the compiler's 0.8-budget saved bytes, plans from the eager
    profile recompute 9 matmuls in backward, plans from this view 2. Bytes
    stay the eager ones (what the solver holds to the budget); the compiled
    peak is measured anyway.

    Example:
        >>> plan = solve(fused_profile(prof), budget, "dp", segments=False)
    """
    return retimed(profile, lambda op: 0.0 if op.flops == 0 else op.time)


def _step(model: nn.Module, loss_fn: LossFn) -> None:
    model.zero_grad(set_to_none=True)
    loss_fn().backward()


def install(model: nn.Module, loss_fn: LossFn, point: CompiledPoint, **compile_kwargs: Any) -> None:
    """Put ``point``'s way of running on ``model`` (plain, then plan and/or compile), in place.

    Example:
        >>> install(model, loss_fn, fit.points[0], backend="inductor")
    """
    uncompile(model)
    remove(model)
    if point.plan is not None:
        apply(model, point.plan)
        compile_planned(model, loss_fn, **compile_kwargs)
        return
    model.compile(**compile_kwargs)
    partitioner = _partitioner_config(point)
    if partitioner:
        compiled = model._compiled_call_impl

        def call(*args: Any, **kwargs: Any) -> Any:
            # Read when the joint graph is partitioned (first call, recompiles).
            import torch._functorch.config as functorch_config

            with functorch_config.patch(**partitioner):
                return compiled(*args, **kwargs)

        model._compiled_call_impl = call


def _partitioner_config(point: CompiledPoint) -> dict[str, Any]:
    """The partitioner settings ``point`` compiles under (empty: torch.compile's default)."""
    if point.saved_fraction is not None:
        return saved_bytes_config(SavedBytesSolver(point.saved_fraction))
    if point.compiler_budget is not None and point.compiler_budget != 1.0:
        return {"activation_memory_budget": point.compiler_budget}
    return {}


def _measure(
    model: nn.Module, loss_fn: LossFn, point: CompiledPoint, repeats: int, compile_kwargs: dict
) -> CompiledPoint:
    torch._dynamo.reset()
    install(model, loss_fn, point, **compile_kwargs)
    peak = compiled_step_peak(model, loss_fn)  # compiles, warms, then measures one step
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _step(model, loss_fn)
        times.append(time.perf_counter() - start)
    return replace(point, peak_bytes=peak, step_time=statistics.median(times))


def measure_points(
    model: nn.Module,
    loss_fn: LossFn,
    *,
    plan_fractions: Iterable[float] = (0.8, 0.6, 0.45, 0.3, 0.15),
    fused_fractions: Iterable[float] = (0.9, 0.8),
    compiler_budgets: Iterable[float] = (1.0, 0.5, 0.1),
    saved_fractions: Iterable[float] = (0.8, 0.65, 0.6, 0.55, 0.5),
    repeats: int = 3,
    **compile_kwargs: Any,
) -> tuple[CompiledPoint, ...]:
    """Compile and measure every candidate; the model is left plain and uncompiled.

    Example:
        >>> points = measure_points(model, loss_fn, backend="inductor")
        >>> [(p.label, p.peak_bytes) for p in points]
    """
    uncompile(model)
    remove(model)
    torch._dynamo.reset()  # the profile below must run the plain eager step
    prof = make_profile(model, loss_fn, repeats=1)
    candidates: list[CompiledPoint] = [
        CompiledPoint(f"compile amb={b:g}", None, float(b), 0, 0.0) for b in compiler_budgets
    ]
    candidates += [
        CompiledPoint(f"compile saved<={f:g}", None, None, 0, 0.0, saved_fraction=float(f))
        for f in saved_fractions
    ]
    seen: set[tuple] = set()
    views = (
        ("gradckpt", prof, plan_fractions),
        ("gradckpt fused", fused_profile(prof), fused_fractions),
    )
    for name, view, fractions in views:
        for fraction in fractions:
            try:
                budget = parse_budget(float(fraction), prof.measured_peak_bytes)
                with allow_chunking(False):  # the compiled graph runs no chunked slices
                    plan = solve(view, budget, "dp", segments=True)
            except BudgetError:
                continue  # below what any plan reaches
            if plan.items in seen:
                continue
            seen.add(plan.items)
            candidates.append(CompiledPoint(f"{name} {fraction:g}", plan, None, 0, 0.0))
    try:
        measured = tuple(_measure(model, loss_fn, c, repeats, compile_kwargs) for c in candidates)
    finally:
        uncompile(model)
        remove(model)
        torch._dynamo.reset()
    return measured


def choose(points: Iterable[CompiledPoint], budget_bytes: int) -> CompiledPoint:
    """The fastest point whose measured peak fits ``budget_bytes`` (ties: the smaller peak).

    Raises:
        BudgetError: no point fits; the message gives the smallest measured peak.

    Example:
        >>> choose(points, 300 * 2**20).label
    """
    points = list(points)
    fitting = [p for p in points if p.peak_bytes <= budget_bytes]
    if not fitting:
        least = min(points, key=lambda p: p.peak_bytes)
        raise BudgetError(
            f"no compiled candidate fits {budget_bytes} bytes at the allocator; the least "
            f"measured peak is {least.peak_bytes} bytes ({least.label}). Raise the budget or "
            "add smaller plan_fractions."
        )
    return min(fitting, key=lambda p: (p.step_time, p.peak_bytes, p.label))


def fit_compiled(
    model: nn.Module,
    loss_fn: LossFn,
    budget: int | float | str,
    *,
    points: Iterable[CompiledPoint] | None = None,
    **options: Any,
) -> CompiledFit:
    """Measure compiled candidates, install the fastest that fits ``budget``; in place.

    Args:
        model, loss_fn: as for :func:`gradckpt.fit`.
        budget: allocator bytes one compiled step may add (int or "300MB"), or
            a fraction of the compiler default's measured peak.
        points: reuse a table from :func:`measure_points` (no re-measuring).
        **options: ``plan_fractions``, ``fused_fractions``, ``compiler_budgets``,
            ``saved_fractions``, ``repeats`` and
            ``torch.compile`` arguments (``backend``, ``mode``, ...).

    Example:
        >>> fit = fit_compiled(model, loss_fn, "300MB", backend="inductor")
        >>> fit.chosen.label, fit.chosen.peak_bytes
    """
    compile_kwargs = {
        k: v for k, v in options.items()
        if k not in _CANDIDATE_OPTIONS
    }  # fmt: skip
    table = tuple(points) if points is not None else measure_points(model, loss_fn, **options)
    default = next((p for p in table if p.compiler_budget == 1.0), None)
    reference = default.peak_bytes if default is not None else max(p.peak_bytes for p in table)
    budget_bytes = parse_budget(budget, reference)
    chosen = choose(table, budget_bytes)
    torch._dynamo.reset()
    install(model, loss_fn, chosen, **compile_kwargs)
    return CompiledFit(budget_bytes, chosen, table)
