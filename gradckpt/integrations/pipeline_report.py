"""Stage plans as data, their table, their comparison with one setting for every stage.

A :class:`StagePlan` is what :func:`gradckpt.integrations.pipeline.plan_stage`
returns on one rank; :func:`gather_stage_plans` collects them from every rank;
:func:`summary` prints the table and :func:`compare` the pipeline's predicted
step time under the per-stage plans next to the best *uniform* setting (the
same plan kind on every stage, as torchtitan's ``--activation-checkpoint.mode``
and Megatron's ``recompute_granularity`` apply it) that fits every stage.

A pipeline step of ``M`` micro-batches on ``P`` stages takes about
``(M + P - 1)`` times its slowest stage's time per micro-batch (GPipe and 1F1B
have the same bubble), which is what :func:`compare` predicts with.

Example:
    >>> plans = gather_stage_plans(stage_plan)
    >>> print(summary(plans))
    >>> compare(plans).speedup
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gradckpt.measure.memory import format_bytes
from gradckpt.planning.plans.plan import Plan, Segment

__all__ = ["Comparison", "StagePlan", "UniformPoint", "compare", "gather_stage_plans", "summary"]


@dataclass(frozen=True)
class UniformPoint:
    """One uniform setting's predicted peak and time on one stage."""

    name: str
    peak_bytes: int
    time_per_microbatch: float


@dataclass(frozen=True)
class StagePlan:
    """One stage's plan and what it is predicted to cost with its in-flight micro-batches."""

    stage_index: int
    num_stages: int
    schedule: str
    n_microbatches: int
    in_flight: int
    plan: Plan
    budget_bytes: int
    predicted_peak_bytes: int
    held_bytes: int  # one micro-batch's activations, forward end to backward, under the plan
    buffer_bytes: int  # receive buffers (M per direction), kept from the first step on
    output_bytes: int  # the last stage's outputs it holds (in flight, or all M returned)
    merged_bytes: int  # the returned outputs merged at the end of the step (0: not returned)
    time_per_microbatch: float  # forward + backward of one micro-batch, predicted
    plain_peak_bytes: int  # no checkpointing, same micro-batches in flight
    plain_time_per_microbatch: float
    uniform: tuple[UniformPoint, ...] = ()
    fake: bool = False

    @property
    def recompute_time(self) -> float:
        """Predicted seconds recomputed per micro-batch (time over the plain step's)."""
        return max(self.time_per_microbatch - self.plain_time_per_microbatch, 0.0)

    def describe(self) -> str:
        """The plan in a few words: units recomputed, selective, in segments, kept."""
        modes: dict[str, int] = {}
        for item in self.plan.items:
            if isinstance(item, Segment):
                modes["in segments"] = modes.get("in segments", 0) + len(item.paths)
            else:
                modes[item.mode] = modes.get(item.mode, 0) + 1
        kept = modes.pop("keep", 0)
        if not modes:
            return "keep all"
        parts = [f"{n} {mode}" for mode, n in sorted(modes.items())]
        return ", ".join([*parts, f"{kept} keep"])

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["plan"] = self.plan.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StagePlan:
        fields = dict(data)
        fields["plan"] = Plan.from_json(data["plan"])
        fields["uniform"] = tuple(UniformPoint(**u) for u in data.get("uniform", ()))
        return cls(**fields)


def gather_stage_plans(stage_plan: StagePlan, group: Any = None) -> list[StagePlan]:
    """Every rank's stage plan, in stage order, on every rank (``all_gather_object``).

    Without a process group it returns ``[stage_plan]``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [stage_plan]
    box: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(box, stage_plan.to_json(), group=group)
    return sorted((StagePlan.from_json(d) for d in box), key=lambda s: s.stage_index)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:,.0f} s"


def summary(plans: Sequence[StagePlan]) -> str:
    """The per-stage table: in flight, plan, predicted peak and time per micro-batch.

    Example:
        >>> print(summary(plans))
    """
    if not plans:
        return "no stages"
    first = plans[0]
    lines = [
        f"pipeline: {first.num_stages} stages, {first.schedule}, {first.n_microbatches} "
        f"micro-batches, budget {format_bytes(first.budget_bytes)} per rank"
        + (" (fake tensors: times estimated for this machine's CPU)" if first.fake else ""),
        f"{'stage':>5}  {'in flight':>9}  {'plan':<34} {'peak':>11} {'plain peak':>11} "
        f"{'time/mb':>10} {'plain':>10}",
    ]
    for s in plans:
        lines.append(
            f"{s.stage_index:>5}  {s.in_flight:>9}  {s.describe():<34} "
            f"{format_bytes(s.predicted_peak_bytes):>11} {format_bytes(s.plain_peak_bytes):>11} "
            f"{_ms(s.time_per_microbatch):>10} {_ms(s.plain_time_per_microbatch):>10}"
        )
    c = compare(plans)
    lines.append(f"predicted step: {_ms(c.step_time)} per-stage plans")
    if c.uniform_name is not None:
        lines.append(
            f"best uniform setting that fits every stage: {c.uniform_name}, "
            f"{_ms(c.uniform_step_time)} ({c.speedup:.2f}x the per-stage plans' time)"
        )
    else:
        lines.append("no uniform setting fits every stage")
    return "\n".join(lines)


@dataclass(frozen=True)
class Comparison:
    """Predicted pipeline step time: per-stage plans vs the best uniform setting that fits."""

    step_time: float
    uniform_name: str | None
    uniform_step_time: float | None

    @property
    def speedup(self) -> float:
        """Uniform step time over the per-stage plans' (>1: per-stage plans are faster)."""
        if self.uniform_step_time is None or self.step_time <= 0:
            return float("nan")
        return self.uniform_step_time / self.step_time


def compare(plans: Sequence[StagePlan]) -> Comparison:
    """Per-stage plans against every uniform setting that fits every stage's budget.

    Example:
        >>> compare(plans).uniform_name
        'every_block'
    """
    ticks = plans[0].n_microbatches + len(plans) - 1
    step = ticks * max(s.time_per_microbatch for s in plans)
    best: tuple[float, str] | None = None
    names = [u.name for u in plans[0].uniform]
    for name in names:
        points = [next(u for u in s.uniform if u.name == name) for s in plans]
        if all(u.peak_bytes <= s.budget_bytes for u, s in zip(points, plans)):
            t = ticks * max(u.time_per_microbatch for u in points)
            if best is None or t < best[0]:
                best = (t, name)
    if best is None:
        return Comparison(step, None, None)
    return Comparison(step, best[1], best[0])
