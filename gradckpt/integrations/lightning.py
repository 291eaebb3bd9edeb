"""``BudgetCallback`` for Lightning: plan ``LightningModule.training_step`` on its first batch.

The callback's ``on_train_batch_start`` receives the first batch as the loop
feeds it (on the device). It plans with ``training_step(batch, batch_idx)`` as
the loss (under the trainer's precision context, so ``precision="bf16-mixed"``
is planned as it trains), applies the plan and logs the plan summary and
predicted against measured peak. Planning leaves the module as it found it
(gradients, buffers, RNG) and ``self.log`` calls made while planning are
dropped, so the losses and the logged metrics are those of a plain run.

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

from gradckpt.integrations.first_batch import FirstBatchBudget, fit_on_batch

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
    """Plan and apply gradckpt on the LightningModule's first training batch.

    Args:
        budget: bytes (int), a string with units ("3GiB") or a fraction in (0, 1]
            of the plain step's peak, as for :func:`gradckpt.fit`.
        loss_from: how to get the loss from ``training_step``'s return value;
            default: the tensor itself or its ``"loss"`` entry.
        **plan_options: passed to :func:`gradckpt.plan` (``blocks``, ``solver``, ...).

    After the first batch: ``callback.plan`` and ``callback.report``
    (:class:`BudgetReport`); the numbers are logged on the ``"gradckpt"`` logger
    and sent to the trainer's loggers as ``gradckpt/*`` metrics.

    Example:
        >>> callback = BudgetCallback(0.5)
        >>> L.Trainer(max_steps=10, callbacks=[callback]).fit(module, loader)
        >>> callback.report.within_budget
        True
    """

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

        with _logging_dropped(pl_module):
            self.plan, self.report = fit_on_batch(
                pl_module, loss_fn, self.budget, **self.plan_options
            )
        r = self.report
        for logger in trainer.loggers:
            logger.log_metrics(
                {
                    "gradckpt/budget_bytes": r.budget_bytes,
                    "gradckpt/predicted_peak_bytes": r.predicted_peak_bytes,
                    "gradckpt/measured_peak_bytes": r.measured_peak_bytes,
                    "gradckpt/baseline_peak_bytes": r.baseline_peak_bytes,
                },
                step=trainer.global_step,
            )
