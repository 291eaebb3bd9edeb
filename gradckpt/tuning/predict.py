"""Each candidate micro-batch under each strategy: its whole-step peak and samples per second.

For a micro-batch size ``b`` (``K = global_batch / b`` micro-batches per
optimizer step) the step is profiled under fake tensors (exact sizes, no
memory), the training step folded in (:mod:`gradckpt.planning.solving.whole_step`)
and its op times replaced by real-derived ones (:mod:`gradckpt.tuning.timing`).
Three strategies are planned on it: no checkpointing, every block recomputed
whole (per-layer checkpointing, what ``gradient_checkpointing=True`` does) and
gradckpt's plan for the budget. A strategy whose predicted peak is over the
budget is kept with ``plan=None``.

Samples per second: ``global_batch / (K * step_time(b) + optimizer_seconds)``.

Example:
    >>> rows = predict_candidates(model, make_loss, sizes, step_for, budget, times, 0.01)
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from gradckpt.planning.planner import Planner
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solve import solve
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.planning.solving.whole_step import with_training_step
from gradckpt.profiling.records import Profile
from gradckpt.profiling.run import profile as profile_step
from gradckpt.profiling.training_step import TrainingStep
from gradckpt.profiling.units import BlockSpec
from gradckpt.tuning.batches import MakeLoss
from gradckpt.tuning.result import TuneCandidate
from gradckpt.tuning.timing import BatchTimes

__all__ = ["fake_profile", "predict_candidates"]


def fake_profile(model: nn.Module, make_loss: MakeLoss, b: int, blocks: BlockSpec) -> Profile:
    """The step at micro-batch ``b`` under fake tensors (value reads answered)."""
    return profile_step(model, make_loss(b), blocks=blocks, fake=True, answer_scalars=True)


def _strategies(whole: Profile, budget: int) -> list[tuple[str, object]]:
    """(strategy, plan or the BudgetError's least peak) for none, per-layer and gradckpt."""
    out: list[tuple[str, object]] = []
    for strategy, solver in (("none", "none"), ("per-layer", "every_block"), ("gradckpt", None)):
        try:
            if solver is None:
                out.append((strategy, Planner(whole).plan(budget)))
            else:
                out.append((strategy, solve(whole, budget, solver)))
        except BudgetError as e:
            out.append((strategy, e.least_peak_bytes))
        except ValueError:  # nothing to checkpoint: per-layer has no blocks
            out.append((strategy, None))
    return out


def predict_candidates(
    fakes: dict[int, Profile],
    step_for: Callable[[int], TrainingStep],
    budget: int,
    times: BatchTimes,
    optimizer_seconds: float,
    global_batch: Callable[[int], int],
) -> list[TuneCandidate]:
    """Every (micro-batch, strategy) with its prediction; ``plan=None`` when over the budget.

    ``step_for(b)``: the training step at micro-batch ``b`` (its accumulation);
    ``global_batch(b)``: samples per optimizer step at ``b``.
    """
    rows = []
    for b in sorted(fakes):
        step = step_for(b)
        whole = with_training_step(times.at(fakes[b], b), step)
        for strategy, found in _strategies(whole, budget):
            if not hasattr(found, "items"):
                rows.append(TuneCandidate(b, step.accumulation_steps, strategy, None,
                                          found if isinstance(found, int) else None, None,
                                          verdict="over budget (predicted)"))  # fmt: skip
                continue
            pred = simulate(whole, found)  # type: ignore[arg-type]
            seconds = step.accumulation_steps * pred.step_time + optimizer_seconds
            rows.append(TuneCandidate(b, step.accumulation_steps, strategy, found,  # type: ignore[arg-type]
                                      pred.peak_bytes, global_batch(b) / seconds))  # fmt: skip
    return rows
