"""Where the split points are yours to choose: the partition whose planned stages balance.

A pipeline step takes about ``(M + P - 1)`` times its slowest stage's time per
micro-batch, and a stage's time depends on its plan: under one byte budget the
first stage of a 1F1B pipeline holds ``P`` micro-batches and recomputes, the last
holds one and carries the head and the loss. An even split of the blocks leaves
those stages unequal; AdaPipe (ASPLOS 2024) chooses the split together with the
recomputation. :func:`balance_partition` does that for a stack of blocks:

* every stage ``s`` with every block count ``c`` is planned for the budget
  (:func:`~gradckpt.integrations.pipeline.plan_stage`, its in-flight micro-batches
  held), each stage role (first, middle, last) and count profiled once;
* the partition (``c_0 + ... + c_{P-1}`` blocks) whose slowest planned stage is the
  fastest is found by a small dynamic program over stages and blocks used;
* the even split (what ``gpt_stages`` and most recipes use) is planned too, and the
  gain is its predicted step time over the balanced one's.

The prediction is the planner's: op times of the stage's profile plus what its
plan recomputes; it leaves out send/recv and the schedule's own work, as
:func:`~gradckpt.integrations.pipeline_report.compare` does.

Example:
    >>> def build(stage, blocks):  # the module stage `stage` would be with `blocks` blocks
    ...     return stage_module(stage, blocks), (one_microbatch_input(stage),)
    >>> found = balance_partition(build, 8, 2, "1f1b", "3MiB", n_microbatches=8,
    ...                           loss=next_token_loss, target=y_mb, fake=True)
    >>> print(found.describe())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from gradckpt.integrations.pipeline_report import StagePlan, compare
from gradckpt.planning.solving.budget import BudgetError

__all__ = ["Balance", "Partition", "balance_partition", "even_split"]

#: ``build(stage_index, blocks)``: that stage's module with ``blocks`` blocks and one
#: micro-batch of its inputs.
StageBuilder = Callable[[int, int], tuple[nn.Module, Sequence[Any]]]


@dataclass(frozen=True)
class Partition:
    """Blocks per stage, each stage's plan, and the pipeline's predicted step time."""

    per_stage: tuple[int, ...]
    plans: tuple[StagePlan, ...]
    step_time: float  # (M + P - 1) x the slowest stage's time per micro-batch


@dataclass(frozen=True)
class Balance:
    """The balanced partition next to the even split (None: no plan fits the even split).

    Example:
        >>> found.gain  # the even split's predicted step time over the balanced one's
        1.18
    """

    best: Partition
    even: Partition | None

    @property
    def gain(self) -> float | None:
        return None if self.even is None else self.even.step_time / self.best.step_time

    def describe(self) -> str:
        def stages(p: Partition) -> str:
            return " / ".join(f"{c} ({s.time_per_microbatch * 1e3:.2f} ms)"
                              for c, s in zip(p.per_stage, p.plans))  # fmt: skip

        best = f"balanced: {stages(self.best)}, step {self.best.step_time * 1e3:.2f} ms"
        if self.even is None:
            return best + "; the even split fits no plan in the budget"
        return (f"{best}\neven:     {stages(self.even)}, step {self.even.step_time * 1e3:.2f} ms"
                f"\npredicted gain: {self.gain:.2f}x")  # fmt: skip


def even_split(blocks: int, num_stages: int) -> tuple[int, ...]:
    """``blocks`` over ``num_stages`` as evenly as they go, the extra ones first.

    Example:
        >>> even_split(10, 4)
        (3, 3, 2, 2)
    """
    return tuple(blocks // num_stages + (i < blocks % num_stages) for i in range(num_stages))


def balance_partition(
    build: StageBuilder,
    blocks: int,
    num_stages: int,
    schedule: Any,
    budget: int | str,
    *,
    n_microbatches: int,
    loss: Callable[[Any, Any], Any],
    target: Any = None,
    **options: Any,
) -> Balance:
    """The split of ``blocks`` blocks into ``num_stages`` stages whose planned stages are
    the most even (see the module docstring); ``options`` as for ``plan_stage``
    (``optimizer``, ``fake``, ``repeats``, ``return_outputs``, ...).

    Raises:
        BudgetError: no partition has a plan for every stage in the budget.

    Example:
        >>> balance_partition(build, 8, 2, "1f1b", "3MiB", n_microbatches=8,
        ...                   loss=next_token_loss, target=y_mb).best.per_stage
        (5, 3)
    """
    from gradckpt.api.verbs import profile
    from gradckpt.integrations.pipeline import plan_stage, stage_loss_fn

    if blocks < num_stages:
        raise ValueError(f"{blocks} blocks cannot fill {num_stages} stages")
    profile_keys = ("repeats", "fake", "blocks", "device")
    profile_options = {k: options[k] for k in profile_keys if k in options}
    plan_options = {k: v for k, v in options.items() if k not in profile_keys}
    profiles: dict[tuple[str, int], Any] = {}
    planned: dict[tuple[int, int], StagePlan | None] = {}

    def stage_plan(s: int, count: int) -> StagePlan | None:
        if (s, count) in planned:
            return planned[(s, count)]
        last = s == num_stages - 1
        role = "first" if s == 0 else "last" if last else "middle"
        module, inputs = build(s, count)
        if (role, count) not in profiles:
            fn = stage_loss_fn(module, inputs, loss=loss if last else None, target=target,
                               received=s > 0)  # fmt: skip
            profiles[(role, count)] = profile(module, fn, **profile_options)
        try:
            sp: StagePlan | None = plan_stage(
                module, inputs, budget, schedule=schedule, stage_index=s, num_stages=num_stages,
                n_microbatches=n_microbatches, loss=loss, target=target,
                profile=profiles[(role, count)], timed_together=False, **plan_options,
            )  # fmt: skip
        except BudgetError:
            sp = None
        planned[(s, count)] = sp
        return sp

    def partition(per_stage: Sequence[int]) -> Partition | None:
        plans = [stage_plan(s, c) for s, c in enumerate(per_stage)]
        if any(p is None for p in plans):
            return None
        fitted = tuple(p for p in plans if p is not None)
        return Partition(tuple(per_stage), fitted, compare(fitted).step_time)

    # best[s][used]: (slowest time, counts) of stages 0..s-1 holding `used` blocks.
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {(0, 0): (0.0, ())}
    for s in range(num_stages):
        left_after = num_stages - s - 1  # every later stage needs a block
        for (stage, used), (slowest, counts) in list(best.items()):
            if stage != s:
                continue
            counts_here = (
                [blocks - used] if left_after == 0 else range(1, blocks - used - left_after + 1)
            )
            for c in counts_here:
                sp = stage_plan(s, c)
                if sp is None:
                    continue
                cand = (max(slowest, sp.time_per_microbatch), (*counts, c))
                key = (s + 1, used + c)
                if key not in best or cand < best[key]:
                    best[key] = cand
    if (num_stages, blocks) not in best:
        raise BudgetError(
            f"no split of {blocks} blocks into {num_stages} stages has a plan for every stage "
            "in the budget: raise it, or use more stages or smaller micro-batches"
        )
    found = partition(best[(num_stages, blocks)][1])
    assert found is not None  # every stage of it was planned above
    return Balance(found, partition(even_split(blocks, num_stages)))
