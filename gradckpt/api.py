"""The verbs users call: ``plan``, ``fit``, ``frontier`` (``apply``/``remove`` live in apply/)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradckpt import integrations
from gradckpt.apply.apply import apply
from gradckpt.plan.budget import parse_budget
from gradckpt.plan.chain import build_chain
from gradckpt.plan.dp import ChainDP
from gradckpt.plan.plan import Plan
from gradckpt.plan.solvers import Solver, _items, finish, none_plan, solve
from gradckpt.profile.records import Profile
from gradckpt.profile.run import profile as profile_step
from gradckpt.profile.units import BlockSpec

__all__ = ["FrontierPoint", "fit", "frontier", "plan", "profile"]

LossFn = Callable[[], torch.Tensor]


def profile(model: nn.Module, loss_fn: LossFn, **options: Any) -> Profile:
    """Measure one training step (``gradckpt.profile``); see :func:`gradckpt.profile.profile`.

    Integrations prepare the model first (transformers: no KV cache while profiling).

    Example:
        >>> prof = gradckpt.profile(model, loss_fn, fake=True)
    """
    with integrations.preparing(model, fake=bool(options.get("fake"))):
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
) -> Plan:
    """The least-recompute checkpointing plan whose peak fits ``budget``; the model is untouched.

    Args:
        model: the model to plan for.
        loss_fn: zero-argument callable: one forward on a representative batch, returns the loss.
        budget: bytes (int), a string with units ("800MB", "1.5GiB"), or a float in
            (0, 1] meaning that fraction of the uncheckpointed peak.
        blocks: the repeated blocks (paths or predicate); found automatically if None.
        solver: "dp" (default) or a baseline name from ``gradckpt.plan.solvers.SOLVERS``.
        repeats: profiled steps to take median op times from.
        profile: a profile from ``gradckpt.profile(...)`` to reuse instead of measuring.
        segments: allow regions that span several units (False for FSDP, whose
            units' parameters are sharded when a segment would recompute them).

    Returns:
        A :class:`Plan` with its predicted peak and overhead.

    Raises:
        BudgetError: no plan fits; the message gives the least reachable peak.

    Example:
        >>> p = gradckpt.plan(model, lambda: model(x).loss, budget="3GiB")
        >>> print(p.summary())
    """
    prof = _profile(model, loss_fn, blocks, repeats, profile)
    return solve(prof, parse_budget(budget, prof.measured_peak_bytes), solver, segments=segments)


def fit(model: nn.Module, loss_fn: LossFn, budget: int | float | str, **options: object) -> Plan:
    """:func:`plan` and :func:`gradckpt.apply` in one call; returns the applied plan.

    Example:
        >>> gradckpt.fit(model, loss_fn, budget=0.5)
        >>> gradckpt.fit(model, loss_fn, budget=0.5, compile={"backend": "inductor"})
    """
    compiled = options.pop("compile", False)  # True or torch.compile kwargs: the plan compiled
    if compiled:
        options.setdefault("segments", False)  # the compiler checkpoints one call per region
    with integrations.training(model):  # transformers: use_cache off for training, said once
        chosen = plan(model, loss_fn, budget, **options)  # type: ignore[arg-type]
        apply(model, chosen)
    if compiled:
        from gradckpt.integrations.compiled import compile as compile_planned

        compile_planned(model, loss_fn, **(compiled if isinstance(compiled, dict) else {}))
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
    prof = _profile(model, loss_fn, blocks, repeats, profile)
    chain = build_chain(prof)
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
