"""Plan the trainer's whole step on its first batch, then measure steps that ran under the plan.

Trainers (Hugging Face ``Trainer``, Lightning) own the loop: the user never
writes a ``loss_fn``. Their callbacks build one from what the trainer runs on
its first batch (``Trainer.compute_loss``, ``LightningModule.training_step``:
reference models and several model calls included) and hand it to
:func:`fit_on_batch`, with the trainer's optimizer and accumulation steps, so
the plan holds the whole training step (:func:`gradckpt.fit`). Planning never
runs the plain step above a budget in bytes (``fit`` profiles it under fake
tensors and checks plans that fit), and leaves the model as it found it.

The :class:`BudgetReport` says what was predicted; it says *measured* only of
real training steps that ran under the plan: :class:`StepsMeasurement` holds an
:class:`~gradckpt.measure.AllocatorTracker` open over the trainer's first
optimizer steps after planning (forward, backward and ``optimizer.step()``;
the second step with the optimizer's state resident).

Nothing here imports a trainer library.

Example:
    >>> plan, report = fit_on_batch(model, lambda: model(**batch).loss, "2GiB", optimizer=opt)
    >>> measuring = StepsMeasurement(model, opt); measuring.start()
    >>> ...  # two optimizer steps of the trainer
    >>> report = report.measured(measuring.finish(), steps=2)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from gradckpt.api import fit
from gradckpt.api.budget import resident_bytes
from gradckpt.api.old_keywords import as_groups
from gradckpt.integrations.steps_measured import StepsMeasurement
from gradckpt.measure.memory import format_bytes, storage_sizes
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.solving.budget import BudgetError, check_budget, read_budget

__all__ = [
    "MEASURED_STEPS",
    "BudgetReport",
    "FirstBatchBudget",
    "StepsMeasurement",
    "checked_callback_options",
    "fit_on_batch",
    "held_bytes",
    "logger",
    "loss_of",
    "torch_optimizer",
]

logger = logging.getLogger("gradckpt")

#: Optimizer steps under the plan that the callbacks measure (the second one runs
#: with the optimizer's state resident).
MEASURED_STEPS = 2


@dataclass(frozen=True)
class BudgetReport:
    """What a trainer callback planned on the first batch, and what steps under the plan measured.

    All figures are whole training steps of the process: parameters and buffers,
    gradients, optimizer state and step temporaries, activations, plus
    ``other_bytes`` (modules the trainer holds besides the planned model, e.g. a
    DPO reference model, resident through the step but not planned).

    ``measured_peak_bytes`` is None until measured: the allocator's high-water
    over the first ``measured_steps`` optimizer steps that ran under the plan
    (:class:`StepsMeasurement`): on CUDA ``max_memory_allocated``; on CPU the
    peak above the level when they began plus what was resident then
    (parameters, buffers, gradients and optimizer state, ``other_bytes``).
    """

    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    baseline_peak_bytes: int
    predicted_overhead: float
    summary: str
    #: The phase of the step that sets the predicted peak ("" when the plan holds
    #: one micro-batch's forward and backward only).
    phase: str = ""
    #: Optimizer steps the measurement covered (0: not measured).
    measured_steps: int = 0
    other_bytes: int = 0

    @property
    def within_budget(self) -> bool | None:
        """Whether the measured whole-step peak stayed within the budget (None: not measured yet)."""
        if self.measured_peak_bytes is None:
            return None
        return self.measured_peak_bytes <= self.budget_bytes

    def measured(self, peak_bytes: int, steps: int) -> BudgetReport:
        """This report with the measured high-water of ``steps`` optimizer steps."""
        return replace(self, measured_peak_bytes=int(peak_bytes), measured_steps=int(steps))

    def line(self) -> str:
        """One line for a training log.

        Example:
            >>> report.line()
            'gradckpt: budget 30.00 MiB; whole-step peak predicted 29.10 MiB (set by the optimizer step), measured 29.12 MiB over 2 steps; plain 48.20 MiB; ...'
        """
        phase = f" (set by the {self.phase})" if self.phase else ""
        if self.measured_peak_bytes is None:
            measured = "not measured yet"
        else:
            steps = "step" if self.measured_steps == 1 else "steps"
            measured = (
                f"measured {format_bytes(self.measured_peak_bytes)} over "
                f"{self.measured_steps} {steps} under the plan"
            )
        return (
            f"gradckpt: budget {format_bytes(self.budget_bytes)}; whole-step peak predicted "
            f"{format_bytes(self.predicted_peak_bytes)}{phase}, {measured}; plain "
            f"{format_bytes(self.baseline_peak_bytes)}; predicted recompute overhead "
            f"{self.predicted_overhead:+.1%}"
        )


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss in a model's or training step's output: a tensor, ``.loss`` or ``["loss"]``.

    Example:
        >>> loss_of(model(input_ids=ids, labels=ids))  # a transformers ModelOutput
        tensor(4.86, grad_fn=...)
    """
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    else:
        raise ValueError(
            f"gradckpt: cannot find the loss in the training step's output "
            f"({type(output).__name__}); return the loss (or a dict/ModelOutput with 'loss'), "
            "e.g. pass labels in the batch, or give the callback loss_from=<output -> loss>"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise ValueError(
            "gradckpt: the training step's loss must be a scalar tensor that requires grad, got "
            f"{type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss


def checked_callback_options(
    budget: int | float | str, loss_from: Callable[[Any], torch.Tensor] | None
) -> Callable[[Any], torch.Tensor]:
    """Validate a trainer callback's budget and ``loss_from`` now, not at the first step.

    Returns the loss extractor to use (:func:`loss_of` when ``loss_from`` is None).

    Example:
        >>> self.loss_from = checked_callback_options("auto", None)
    """
    check_budget(budget)
    if loss_from is not None and not callable(loss_from):
        raise TypeError(f"loss_from must be callable, got {type(loss_from).__name__}")
    return loss_from or loss_of


class FirstBatchBudget:
    """What every trainer callback takes and keeps: the budget, the loss extractor, the plan.

    A mixin placed before the trainer library's own callback base class, so the
    Hugging Face and Lightning callbacks check their arguments the same way (at
    construction, not at the first step) and expose the same attributes:
    ``budget``, ``loss_from``, ``plan_options``, and after the first batch
    ``plan`` and ``report``.

    Args:
        budget: bytes (int), a string with units ("3GiB"), ``"auto"`` (the device's
            memory) or a fraction in (0, 1] of the plain step's peak, as for
            :func:`gradckpt.fit`.
        loss_from: how to get the loss from the step's output; default
            :func:`loss_of`.
        plan: a plan made already (``gradckpt.tune(...).plan``): applied as it is on
            the first batch instead of planning there (nothing is profiled); the
            steps under it are measured all the same.
        **plan_options: passed to :func:`gradckpt.fit`; they override what the
            callback passes itself (``optimizer``, ``accumulation_steps``,
            ``set_to_none``): ``optimizer=None`` plans without counting it.

    Example:
        >>> class BudgetCallback(FirstBatchBudget, TrainerCallback): ...
        >>> BudgetCallback("2GiB").loss_from is loss_of
        True
        >>> BudgetCallback(result.budget_bytes, plan=result.plan)  # gradckpt.tune's
    """

    def __init__(
        self,
        budget: int | float | str,
        *,
        loss_from: Callable[[Any], torch.Tensor] | None = None,
        plan: Plan | None = None,
        **plan_options: Any,
    ) -> None:
        super().__init__()
        self.loss_from = checked_callback_options(budget, loss_from)
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan must be a gradckpt.Plan, got {type(plan).__name__}")
        self.budget = budget
        self.plan_options = plan_options
        #: The plan given to apply instead of planning (None: plan on the first batch).
        self.ready_plan = plan
        self.plan: Plan | None = None
        self.report: BudgetReport | None = None

    # The steps under the plan being measured, and the trainer's step count when they began.
    _measuring: StepsMeasurement | None = None
    _first_step = 0

    def _abort_measuring(self) -> None:
        measuring, self._measuring = self._measuring, None
        if measuring is not None:
            measuring.abort()

    def _measured_steps(self, global_step: int) -> int | None:
        """End the measurement; the report now says what it measured. The number of
        optimizer steps it covered, or None when there was nothing to report."""
        measuring, self._measuring = self._measuring, None
        peak = measuring.finish() if measuring is not None else None
        if peak is None or self.report is None:
            return None
        steps = min(MEASURED_STEPS, global_step - self._first_step)
        self.report = self.report.measured(peak, steps)
        logger.info("%s", self.report.line())
        return steps


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a trainer's wrapper (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``), or None.

    Example:
        >>> torch_optimizer(trainer.optimizer)  # AcceleratedOptimizer -> torch.optim.AdamW
    """
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            inner = getattr(optimizer, "_optimizer", None)  # LightningOptimizer
        if isinstance(inner, torch.optim.Optimizer):
            optimizer = inner
            continue
        break
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def _module_tensors(modules: Iterable[nn.Module]) -> Iterable[torch.Tensor]:
    for module in modules:
        yield from module.parameters()
        yield from module.buffers()


def held_bytes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    others: Iterable[nn.Module] = (),
) -> int:
    """:func:`gradckpt.api.budget.resident_bytes`: what a training step holds throughout.

    Example:
        >>> held_bytes(model, opt)  # after a step: params + grads + AdamW's two moments
    """
    return resident_bytes(model, optimizer, others)


def _other_bytes(model: nn.Module, others: Iterable[nn.Module]) -> int:
    """Parameter and buffer bytes of ``others`` that are not ``model``'s."""
    own = storage_sizes(_module_tensors([model]))
    theirs = storage_sizes(_module_tensors(others))
    return sum(n for key, n in theirs.items() if key not in own)


def fit_on_batch(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    budget: int | float | str,
    *,
    others: Iterable[nn.Module] = (),
    plan: Plan | None = None,
    **plan_options: Any,
) -> tuple[Plan, BudgetReport]:
    """``gradckpt.fit`` on the trainer's step on this batch (or ``plan`` applied); nothing more is run.

    Args:
        model: the module the trainer trains (planned and applied).
        loss_fn: zero-argument callable: the trainer's step on the first batch
            (its loss), e.g. ``Trainer.compute_loss`` with a reference model.
        budget: as for :func:`gradckpt.fit`, for the whole process's step.
        others: modules the step also holds (a reference model): their parameters
            and buffers are resident but not planned; a budget in bytes is lowered
            by them before planning, and every figure of the report includes them.
        plan: a plan made already (``gradckpt.tune``'s): applied as it is (with the
            model's training switches: transformers' ``use_cache`` off), not planned;
            ``loss_fn`` is not called. A warning if it was made for other
            ``accumulation_steps`` than ``plan_options`` says.
        **plan_options: passed to :func:`gradckpt.fit` (``optimizer``,
            ``accumulation_steps``, ``blocks``, ``solver``, ...).

    Returns:
        The applied plan and its :class:`BudgetReport`, not measured yet (also
        logged at INFO on the ``"gradckpt"`` logger).

    Raises:
        BudgetError: nothing fits (the model is left plain).

    Example:
        >>> plan, report = fit_on_batch(model, lambda: model(**batch).loss, "2GiB", optimizer=opt)
    """
    others = [m for m in others if m is not model]
    other = _other_bytes(model, others)
    kind, value = read_budget(budget)
    planned_budget = budget
    if other and kind == "bytes":
        planned_budget = int(value) - other
        if planned_budget <= 0:
            raise BudgetError(
                f"the modules the step holds besides the model ({format_bytes(other)}: "
                f"{', '.join(type(m).__name__ for m in others)}) alone exceed the budget of "
                f"{format_bytes(int(value))}",
                least_peak_bytes=other,
            )
    if plan is None:
        plan = fit(model, loss_fn, planned_budget, **as_groups(plan_options))
        budget_bytes = int(plan.budget_bytes or plan.baseline_peak_bytes) + other
    else:
        _apply_ready(model, plan, plan_options.get("accumulation_steps"))
        budget_bytes = int(value) if kind == "bytes" else int(plan.budget_bytes or 0) + other
    report = BudgetReport(
        budget_bytes=budget_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes + other,
        measured_peak_bytes=None,
        baseline_peak_bytes=plan.baseline_peak_bytes + other,
        predicted_overhead=plan.predicted_overhead,
        summary=plan.summary(),
        phase=plan.step.phase if plan.step is not None else "",
        other_bytes=other,
    )
    logger.info("%s\n%s", report.line(), report.summary)
    return plan, report


def _apply_ready(model: nn.Module, plan: Plan, accumulation_steps: int | None) -> None:
    """Install a plan made beforehand, as ``fit`` installs its own (training switches on)."""
    from gradckpt.apply.apply import apply
    from gradckpt.profiling import adapters

    planned = plan.step.accumulation_steps if plan.step is not None else None
    if accumulation_steps is not None and planned is not None and planned != accumulation_steps:
        warnings.warn(
            f"gradckpt: the plan was made for {planned} micro-batches per optimizer step, the "
            f"trainer runs {accumulation_steps}: its predicted peak is for {planned}",
            stacklevel=3,
        )
    with adapters.training(model):  # transformers: use_cache off, its own checkpointing off
        apply(model, plan)
