"""Plan on the first real training batch: the piece the trainer callbacks share.

Trainers (Hugging Face ``Trainer``, Lightning) own the loop: the user never
writes a ``loss_fn``. Their callbacks see the first batch as the loop feeds it
(after the collator, on the device) and hand this module a zero-argument loss
built from it. :func:`fit_on_batch` plans and applies, then measures one step
of the planned model (leaving gradients, buffers and RNG as it found them, so
the real step that follows is the step a plain run takes) and returns a
:class:`BudgetReport`: the plan summary and predicted against measured peak.

Nothing here imports a trainer library.

Example:
    >>> report = fit_on_batch(model, lambda: model(**batch).loss, budget=0.6)
    >>> print(report.line())
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradckpt.api import fit, profile
from gradckpt.measure.memory import MemoryTracker, format_bytes
from gradckpt.planning.budget import parse_budget
from gradckpt.planning.plan import Plan

__all__ = [
    "BudgetReport",
    "FirstBatchBudget",
    "checked_callback_options",
    "fit_on_batch",
    "logger",
    "loss_of",
]

logger = logging.getLogger("gradckpt")


@dataclass(frozen=True)
class BudgetReport:
    """What a trainer callback planned on the first batch, and what the planned step measured.

    ``measured_peak_bytes`` is the live-storage peak (parameters and buffers plus
    what the step created) of one forward+backward of the planned model on that
    batch, the quantity ``predicted_peak_bytes`` predicts.
    """

    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    baseline_peak_bytes: int
    predicted_overhead: float
    summary: str

    @property
    def within_budget(self) -> bool:
        """Whether the measured peak stayed within the budget."""
        return self.measured_peak_bytes <= self.budget_bytes

    def line(self) -> str:
        """One line for a training log.

        Example:
            >>> report.line()
            'gradckpt: budget 1.20 MiB; peak predicted 1.18 MiB, measured 1.18 MiB ...'
        """
        return (
            f"gradckpt: budget {format_bytes(self.budget_bytes)}; peak predicted "
            f"{format_bytes(self.predicted_peak_bytes)}, measured "
            f"{format_bytes(self.measured_peak_bytes)} (plain "
            f"{format_bytes(self.baseline_peak_bytes)}); predicted recompute overhead "
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
        >>> self.loss_from = checked_callback_options("2GiB", None)
    """
    parse_budget(budget, 1)
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
        budget: bytes (int), a string with units ("3GiB") or a fraction in (0, 1]
            of the plain step's peak, as for :func:`gradckpt.fit`.
        loss_from: how to get the loss from the step's output; default
            :func:`loss_of`.
        **plan_options: passed to :func:`fit_on_batch`.

    Example:
        >>> class BudgetCallback(FirstBatchBudget, TrainerCallback): ...
        >>> BudgetCallback("2GiB").loss_from is loss_of
        True
    """

    def __init__(
        self,
        budget: int | float | str,
        *,
        loss_from: Callable[[Any], torch.Tensor] | None = None,
        **plan_options: Any,
    ) -> None:
        super().__init__()
        self.loss_from = checked_callback_options(budget, loss_from)
        self.budget = budget
        self.plan_options = plan_options
        self.plan: Plan | None = None
        self.report: BudgetReport | None = None


@contextmanager
def _step_left_as_found(model: nn.Module) -> Iterator[None]:
    """Run a step whose gradients, buffer updates and RNG draws are all undone afterwards."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    for p in params:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=_cuda_devices(model)):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for p, g in zip(params, grads):
            p.grad = g


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})


def measure_step(model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> MemoryTracker:
    """One ``loss_fn().backward()`` under a :class:`MemoryTracker`; the model is left as found.

    Example:
        >>> measure_step(model, loss_fn).peak_bytes
    """
    with _step_left_as_found(model), MemoryTracker(model) as tracker:
        loss_fn().backward()
    return tracker


def fit_on_batch(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    budget: int | float | str,
    **plan_options: Any,
) -> tuple[Plan, BudgetReport]:
    """``gradckpt.fit`` on this batch, then one measured step of the planned model.

    Args:
        model: the module the trainer trains.
        loss_fn: zero-argument callable: the trainer's forward on the first batch.
        budget: as for :func:`gradckpt.fit`.
        **plan_options: passed to :func:`gradckpt.fit` (``blocks``, ``solver``,
            ``measure_candidates``, ...). When ``loss_fn`` never calls ``model``'s own
            forward, ``segments`` defaults to False (segments open only inside it).

    Returns:
        The applied plan and its :class:`BudgetReport` (also logged at INFO on the
        ``"gradckpt"`` logger).

    Example:
        >>> plan, report = fit_on_batch(model, lambda: model(**batch).loss, "2GiB")
    """
    options = dict(plan_options)
    if options.get("profile") is None:
        # A trainer's step need not call the module's own forward (Lightning's
        # training_step often calls a submodule); a plan's multi-unit segments
        # open only inside that forward, so without it plan unit by unit.
        calls: list[None] = []
        hook = model.register_forward_pre_hook(lambda module, args: calls.append(None))
        try:
            options["profile"] = profile(
                model, loss_fn, blocks=options.get("blocks"), repeats=options.get("repeats", 3)
            )
        finally:
            hook.remove()
        if not calls:
            options.setdefault("segments", False)
    plan = fit(model, loss_fn, budget, **options)
    measured = measure_step(model, loss_fn)
    report = BudgetReport(
        budget_bytes=int(plan.budget_bytes or plan.baseline_peak_bytes),
        predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_peak_bytes=measured.peak_bytes,
        baseline_peak_bytes=plan.baseline_peak_bytes,
        predicted_overhead=plan.predicted_overhead,
        summary=plan.summary(),
    )
    logger.info("%s\n%s", report.line(), report.summary)
    return plan, report
