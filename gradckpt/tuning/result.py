"""What :func:`gradckpt.tune` found: every candidate, predicted and measured, and the choice.

Example:
    >>> result = gradckpt.tune(model, make_loss, "auto", optimizer=opt, global_batch=32)
    >>> print(result.table())
    >>> result.apply(model)  # then train with result.micro_batch x result.accumulation_steps
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gradckpt.measure.memory import format_bytes
from gradckpt.planning.plans.plan import Plan

__all__ = ["TuneCandidate", "TuneResult"]

#: How a candidate checkpoints: not at all, every block whole (what ``gradient_checkpointing=True``
#: does), or gradckpt's plan for the budget.
STRATEGIES = ("none", "per-layer", "gradckpt")


@dataclass(frozen=True)
class TuneCandidate:
    """One micro-batch size under one strategy, predicted and (if run) measured.

    ``samples_per_s`` count the whole optimizer step: ``accumulation_steps``
    micro-batches of forward and backward, then the optimizer's step.
    ``verdict``: "chosen", "slower", "over budget (...)", "not measured (...)".
    """

    micro_batch: int
    accumulation_steps: int
    strategy: str
    plan: Plan | None = field(repr=False)
    predicted_peak_bytes: int | None
    predicted_samples_per_s: float | None
    measured_samples_per_s: float | None = None
    #: Samples per second of each measured round, in order (the median is above).
    measured_rounds: tuple[float, ...] = ()
    measured_peak_bytes: int | None = None
    verdict: str = ""

    @property
    def measured_spread(self) -> tuple[float, float] | None:
        """Least and greatest samples per second over the measured rounds."""
        return (
            (min(self.measured_rounds), max(self.measured_rounds)) if self.measured_rounds else None
        )


@dataclass(frozen=True)
class TuneResult:
    """The micro-batch, accumulation and plan that trained fastest in the budget."""

    micro_batch: int
    accumulation_steps: int
    strategy: str
    plan: Plan = field(repr=False)
    budget_bytes: int
    candidates: tuple[TuneCandidate, ...] = field(repr=False)
    planning_seconds: float
    measuring_seconds: float
    #: How op times at other micro-batch sizes were made (see gradckpt.tuning.timing).
    timing: str = ""

    def apply(self, model: nn.Module) -> Plan:
        """Install the chosen plan on ``model`` (train at ``micro_batch`` x ``accumulation_steps``).

        Example:
            >>> result.apply(model)
        """
        from gradckpt.apply.apply import apply
        from gradckpt.profiling import adapters

        with adapters.training(model):  # as fit does (transformers: no KV cache in training)
            apply(model, self.plan)
        return self.plan

    def table(self) -> str:
        """Every candidate: micro-batch, strategy, peak, samples/s predicted and measured, verdict."""
        head = (
            f"gradckpt tune: budget {format_bytes(self.budget_bytes)}; chosen micro-batch "
            f"{self.micro_batch} x {self.accumulation_steps} accumulation, {self.strategy}\n"
            f"  op times: {self.timing}; planning {self.planning_seconds:.1f} s, measured steps "
            f"{self.measuring_seconds:.1f} s\n"
        )
        rows = [
            f"  {'micro':>5} {'accum':>5}  {'strategy':<10} {'peak (pred)':>12} "
            f"{'samples/s pred':>15} {'measured':>10}  verdict"
        ]
        for c in self.candidates:
            peak = format_bytes(c.predicted_peak_bytes) if c.predicted_peak_bytes else "-"
            pred = f"{c.predicted_samples_per_s:.2f}" if c.predicted_samples_per_s else "-"
            meas = f"{c.measured_samples_per_s:.2f}" if c.measured_samples_per_s else "-"
            rows.append(
                f"  {c.micro_batch:>5} {c.accumulation_steps:>5}  {c.strategy:<10} {peak:>12} "
                f"{pred:>15} {meas:>10}  {c.verdict}"
            )
        return head + "\n".join(rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "gradckpt.TuneResult",
            "version": 1,
            "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation_steps,
            "strategy": self.strategy,
            "plan": self.plan.to_json(),
            "budget_bytes": self.budget_bytes,
            "planning_seconds": self.planning_seconds,
            "measuring_seconds": self.measuring_seconds,
            "timing": self.timing,
            "candidates": [
                {
                    "micro_batch": c.micro_batch,
                    "accumulation_steps": c.accumulation_steps,
                    "strategy": c.strategy,
                    "predicted_peak_bytes": c.predicted_peak_bytes,
                    "predicted_samples_per_s": c.predicted_samples_per_s,
                    "measured_samples_per_s": c.measured_samples_per_s,
                    "measured_rounds": list(c.measured_rounds),
                    "measured_peak_bytes": c.measured_peak_bytes,
                    "verdict": c.verdict,
                }
                for c in self.candidates
            ],
        }
