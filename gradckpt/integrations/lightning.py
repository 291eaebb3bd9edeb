"""``BudgetCallback`` for Lightning: plan ``LightningModule.training_step`` on its first batch.

The callback's ``on_train_batch_start`` receives the first batch as the loop
feeds it (on the device). It plans with ``training_step(batch, batch_idx)`` as
the loss (under the trainer's precision context, so ``precision="bf16-mixed"``
is planned as it trains), for the whole training step: the trainer's first
optimizer and ``accumulate_grad_batches`` are passed to :func:`gradckpt.fit`,
with ``set_to_none=False`` (Lightning clears gradients after ``training_step``'s
forward, so the previous step's gradients are resident through it). Planning
never runs the plain step above a budget in bytes, leaves the module as it found
it (gradients, buffers, RNG), and ``self.log`` calls made while planning are
dropped, so the losses and the logged metrics are those of a plain run.

The report's measured peak comes from the trainer's own steps under the plan:
the allocator's high-water from the first batch (after planning) to the end of
the batch that completes the second optimizer step. Until then
``report.measured_peak_bytes`` is None.

Requires automatic optimization: a ``training_step`` that calls
``manual_backward`` and steps optimizers itself cannot be replayed as a loss.

Importing this module imports Lightning (``lightning.pytorch``, or the older
``pytorch_lightning`` package when that is the one installed).

Example:
    >>> from gradckpt.integrations.lightning import BudgetCallback
    >>> trainer = L.Trainer(max_steps=100, callbacks=[BudgetCallback("2GiB")])
    >>> trainer.fit(module, dataloader)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package of Lightning < 2
    from pytorch_lightning import Callback

from gradckpt.integrations.first_batch import (
    MEASURED_STEPS,
    FirstBatchBudget,
    StepsMeasurement,
    fit_on_batch,
    torch_optimizer,
)

__all__ = ["BudgetCallback"]


@contextlib.contextmanager
def _logging_dropped(module: nn.Module) -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing: planning runs the step several times."""

    def drop(*args: Any, **kwargs: Any) -> None:
        return None

    module.log = drop  # type: ignore[method-assign]
    module.log_dict = drop  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


class BudgetCallback(FirstBatchBudget, Callback):
    """Plan and apply gradckpt on the LightningModule's first training batch, then measure.

    Args:
        budget: bytes (int), a string with units ("3GiB"), ``"auto"`` (the device's
            memory) or a fraction in (0, 1] of the plain step's peak, as for
            :func:`gradckpt.fit`; for the whole training step.
        loss_from: how to get the loss from ``training_step``'s return value;
            default: the tensor itself or its ``"loss"`` entry.
        plan: a plan made already (``gradckpt.tune(..., set_to_none=False).plan``: the
            gradients are resident through ``training_step``; train with the result's
            micro-batch and ``accumulate_grad_batches=result.accumulation_steps``):
            applied on the first batch instead of planning there.
        **plan_options: passed to :func:`gradckpt.fit` (``blocks``, ``solver``, ...),
            over what the callback passes itself: the trainer's first optimizer,
            ``accumulation_steps`` and ``set_to_none=False`` (``optimizer=None``
            turns counting the optimizer off).

    After the first batch: ``callback.plan`` and ``callback.report``
    (:class:`BudgetReport`), measured after the second optimizer step; the numbers
    are logged on the ``"gradckpt"`` logger and sent to the trainer's loggers as
    ``gradckpt/*`` metrics.

    Example:
        >>> callback = BudgetCallback("2GiB")
        >>> L.Trainer(max_steps=10, callbacks=[callback]).fit(module, loader)
        >>> callback.report.within_budget
        True
    """

    # Until the first batch: not measuring.

    def on_train_batch_start(
        self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        if self.plan is not None:
            return
        if not getattr(pl_module, "automatic_optimization", True):
            raise ValueError(
                "gradckpt.BudgetCallback needs automatic optimization: a training_step that "
                "calls manual_backward cannot be replayed for planning. Plan it yourself with "
                "gradckpt.fit(module, loss_fn, budget) on a batch."
            )
        precision = trainer.strategy.precision_plugin

        def loss_fn() -> torch.Tensor:
            with precision.train_step_context():
                return self.loss_from(pl_module.training_step(batch, batch_idx))

        optimizers = list(getattr(trainer, "optimizers", None) or ())
        optimizer = torch_optimizer(optimizers[0]) if optimizers else None
        options = {
            "optimizer": optimizer,
            "accumulation_steps": int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
            # Lightning zeroes gradients after training_step's forward, before backward.
            "set_to_none": False,
            **self.plan_options,
        }
        with _logging_dropped(pl_module):
            self.plan, self.report = fit_on_batch(
                pl_module, loss_fn, self.budget, plan=self.ready_plan, **options
            )
        self._log(trainer, planned=True)
        measuring = StepsMeasurement(pl_module, optimizer)
        self._first_step = trainer.global_step
        if measuring.start():
            self._measuring = measuring

    def on_train_batch_end(
        self, trainer: Any, pl_module: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._measuring is not None and trainer.global_step - self._first_step >= MEASURED_STEPS:
            self._finish_measuring(trainer)

    def on_train_end(self, trainer: Any, pl_module: nn.Module) -> None:
        if self._measuring is not None:  # training ended before the second step
            self._finish_measuring(trainer)

    def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
        self._abort_measuring()

    def _finish_measuring(self, trainer: Any) -> None:
        if self._measured_steps(trainer.global_step) is not None:
            self._log(trainer, planned=False)

    def _log(self, trainer: Any, *, planned: bool) -> None:
        r = self.report
        assert r is not None
        if planned:
            metrics = {
                "gradckpt/budget_bytes": r.budget_bytes,
                "gradckpt/predicted_peak_bytes": r.predicted_peak_bytes,
                "gradckpt/baseline_peak_bytes": r.baseline_peak_bytes,
            }
        else:
            metrics = {
                "gradckpt/measured_peak_bytes": r.measured_peak_bytes,
                "gradckpt/measured_steps": r.measured_steps,
            }
        for logger_ in trainer.loggers:
            logger_.log_metrics(metrics, step=trainer.global_step)
