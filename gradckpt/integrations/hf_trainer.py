"""``BudgetCallback``: a memory budget for the Hugging Face ``Trainer`` instead of ``gradient_checkpointing=True``.

The callback plans on the first training batch, as the Trainer feeds it (after
the collator, on the device, with ``num_items_in_batch`` when the Trainer adds
it), applies the plan and logs the plan summary with predicted and measured
peak. Planning leaves the model as it found it (gradients, buffers, RNG), so the
losses are those of a plain Trainer run with the same seed.

* ``gradient_accumulation_steps``: planned on the first micro-batch; every
  micro-batch has that shape.
* ``bf16=True``: the Trainer (through accelerate) runs the forward under
  autocast, on CPU too; the planning forward goes through the same
  ``model.forward`` and so is planned under the same autocast.
* ``save_strategy``: the plan wraps forwards only; parameter names and the
  state dict are unchanged, so checkpoints load into a plain model.
* resuming: a new Trainer plans again on its own first batch; the data it skips
  is never run.
* evaluation: layers run plainly under ``no_grad``, and ``model.generate``
  passes ``use_cache=True`` itself, so generation keeps its KV cache while
  training runs without one (``gradckpt.fit`` turns ``use_cache`` off).

Importing this module imports transformers (``gradckpt.integrations.hf``
re-exports ``BudgetCallback`` lazily).

Example:
    >>> from gradckpt.integrations.hf import BudgetCallback
    >>> trainer = Trainer(model, args, train_dataset=data,
    ...                   callbacks=[BudgetCallback("2GiB")])
    >>> trainer.train()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from gradckpt.integrations.first_batch import FirstBatchBudget, fit_on_batch

__all__ = ["BudgetCallback"]


class BudgetCallback(FirstBatchBudget, TrainerCallback):
    """Plan and apply gradckpt on the Trainer's first training batch.

    Args:
        budget: bytes (int), a string with units ("3GiB") or a fraction in (0, 1]
            of the plain step's peak, as for :func:`gradckpt.fit`.
        loss_from: how to get the loss from the model's output; default: its
            ``loss`` (the Trainer's own default when the batch has labels).
        **plan_options: passed to :func:`gradckpt.plan` (``blocks``, ``solver``,
            ``repeats``, ...).

    After the first step: ``callback.plan`` (the applied :class:`gradckpt.Plan`)
    and ``callback.report`` (:class:`BudgetReport`); the numbers are logged on the
    ``"gradckpt"`` logger and added to ``trainer.state.log_history``.

    Example:
        >>> callback = BudgetCallback(0.5)
        >>> Trainer(model, args, train_dataset=data, callbacks=[callback]).train()
        >>> callback.report.measured_peak_bytes <= callback.report.budget_bytes
        True
    """

    # The arguments are FirstBatchBudget's. Until the first training batch: no
    # hook, not planning, nothing logged (set per instance once that changes).
    _hook: torch.utils.hooks.RemovableHandle | None = None
    _planning = False
    _logged = False

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise TypeError(
                "gradckpt.BudgetCallback: the Trainer passed no model to on_train_begin"
            )
        if self.plan is not None or self._hook is not None:
            return  # train() called again on a planned model: the plan stays
        self._hook = model.register_forward_pre_hook(self._plan_first_call, with_kwargs=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.report is not None and not self._logged:
            self._logged = True
            r = self.report
            state.log_history.append(
                {
                    "gradckpt_budget_bytes": r.budget_bytes,
                    "gradckpt_predicted_peak_bytes": r.predicted_peak_bytes,
                    "gradckpt_measured_peak_bytes": r.measured_peak_bytes,
                    "gradckpt_baseline_peak_bytes": r.baseline_peak_bytes,
                    "gradckpt_predicted_overhead": r.predicted_overhead,
                    "step": state.global_step,
                }
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_hook()  # training that never ran a step leaves no hook behind

    # ------------------------------------------------------------------ planning

    def _plan_first_call(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        # The first training forward: the batch exactly as the Trainer feeds it.
        # Evaluation (eval_on_start, no_grad) and our own planning calls pass through.
        if self._planning or not module.training or not torch.is_grad_enabled():
            return
        self._planning = True
        try:

            def loss_fn() -> torch.Tensor:
                return self.loss_from(module(*args, **kwargs))

            self.plan, self.report = fit_on_batch(module, loss_fn, self.budget, **self.plan_options)
        finally:
            self._planning = False
            self._remove_hook()

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
