"""``BudgetCallback``: a memory budget for the Hugging Face ``Trainer`` instead of ``gradient_checkpointing=True``.

The callback plans the step the Trainer runs: ``trainer.compute_loss(model,
inputs, ...)`` on the first training batch, as the Trainer feeds it (after the
collator, on the device, with ``num_items_in_batch``), so everything in it is
planned: a TRL ``DPOTrainer``'s reference model running while the policy's
activations are alive, several model calls. The Trainer's optimizer and
``gradient_accumulation_steps`` are passed to :func:`gradckpt.fit`, so the
budget holds the whole training step (parameters, gradients, optimizer state
and step, activations). Modules the Trainer holds besides the model (a
reference model) are resident too: a budget in bytes is lowered by them.
Planning never runs the plain step above a budget in bytes and leaves the model
as it found it (gradients, buffers, RNG), so the losses are those of a plain
Trainer run with the same seed.

The report's measured peak comes from the Trainer's own steps under the plan:
the allocator's high-water from the first training call after planning to the
end of the second optimizer step (``optimizer.step()`` and the resident
optimizer state included). Until then ``report.measured_peak_bytes`` is None.

How the callback reaches the Trainer: transformers passes callbacks no Trainer,
so ``on_train_begin`` finds the ``Trainer`` whose method called it on the call
stack; where that fails, ``BudgetCallback(...).attach(trainer)``. The instance's
``compute_loss`` (and, while measuring, ``training_step``) are wrapped until
training ends.

* ``bf16=True``: ``compute_loss`` runs inside the Trainer's autocast, and so is
  planned under it.
* ``save_strategy``: the plan wraps forwards only; parameter names and the
  state dict are unchanged, so checkpoints load into a plain model.
* resuming: a new Trainer plans again on its own first batch (the optimizer
  state it loaded is counted).
* evaluation: ``compute_loss`` under ``no_grad`` passes through; layers run
  plainly, and ``model.generate`` keeps its KV cache.

Importing this module imports transformers (``gradckpt.integrations.hf``
re-exports ``BudgetCallback`` lazily).

Example:
    >>> from gradckpt.integrations.hf import BudgetCallback
    >>> trainer = Trainer(model, args, train_dataset=data,
    ...                   callbacks=[BudgetCallback("2GiB")])
    >>> trainer.train()
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from gradckpt.integrations.first_batch import (
    MEASURED_STEPS,
    FirstBatchBudget,
    StepsMeasurement,
    fit_on_batch,
    torch_optimizer,
)

__all__ = ["BudgetCallback"]


def _calling_trainer() -> Trainer | None:
    """The ``Trainer`` whose method is on the call stack (it runs the callback handler)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


class _Wrapped:
    """An instance attribute that shadows a method; undone only if it is still ours."""

    def __init__(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self.obj, self.name, self.wrapper = obj, name, wrapper
        self.had, self.old = name in vars(obj), vars(obj).get(name)
        setattr(obj, name, wrapper)

    def undo(self) -> None:
        if vars(self.obj).get(self.name) is not self.wrapper:
            return  # wrapped again by someone else since: ours stays a pass-through
        if self.had:
            setattr(self.obj, self.name, self.old)
        else:
            delattr(self.obj, self.name)


def _others(trainer: Trainer, model: nn.Module) -> list[nn.Module]:
    """Modules the Trainer holds besides the model (reference, reward, teacher models)."""
    found: list[nn.Module] = []
    for name, value in vars(trainer).items():
        if name in ("model", "model_wrapped") or not isinstance(value, nn.Module):
            continue
        if value is model or any(value is m for m in found):
            continue
        inner = getattr(value, "module", None)  # a DDP wrapper around the model
        if inner is model:
            continue
        found.append(value)
    return found


#: transformers' Trainer reads the loss as ``outputs["loss"]`` or ``outputs[0]``: a model
#: that returns its loss as a bare scalar tensor fails there (indexing a 0-dim tensor),
#: before anything the callback's ``loss_from`` could read.
_NO_LOSS_IN_OUTPUT = (
    "gradckpt: the Trainer's compute_loss could not read a loss from the model's output: "
    "it takes outputs['loss'] or outputs[0], and the model returned a bare scalar tensor. "
    "Return a dict or ModelOutput with 'loss' from the model's forward, or give the Trainer "
    "compute_loss_func=(outputs, labels, num_items_in_batch) -> loss; the callback's "
    "loss_from reads what compute_loss returns, so it cannot help here."
)


class BudgetCallback(FirstBatchBudget, TrainerCallback):
    """Plan and apply gradckpt on the Trainer's first training step, then measure two under it.

    Args:
        budget: bytes (int), a string with units ("3GiB"), ``"auto"`` (the device's
            memory) or a fraction in (0, 1] of the plain step's peak, as for
            :func:`gradckpt.fit`; for the whole training step.
        loss_from: how to get the loss from what ``compute_loss`` returns (a
            ``(loss, outputs)`` pair is unpacked first); default: the tensor itself.
        plan: a plan made already (``gradckpt.tune``'s, or
            :func:`gradckpt.integrations.hf.tune_training_args`'): applied on the first
            step instead of planning there; the two steps after are measured.
        **plan_options: passed to :func:`gradckpt.fit` (``blocks``, ``solver``,
            ``repeats``, ...), over what the callback passes itself: the Trainer's
            ``optimizer`` and ``accumulation_steps`` (``optimizer=None`` turns
            counting the optimizer off).

    After the first step: ``callback.plan`` (the applied :class:`gradckpt.Plan`)
    and ``callback.report`` (:class:`BudgetReport`), measured after the second
    optimizer step; the numbers are logged on the ``"gradckpt"`` logger and
    added to ``trainer.state.log_history``.

    Example:
        >>> callback = BudgetCallback("3GiB")
        >>> Trainer(model, args, train_dataset=data, callbacks=[callback]).train()
        >>> callback.report.within_budget
        True
        >>> BudgetCallback("auto").attach(trainer)  # where the Trainer cannot be found
    """

    # Until training begins: no trainer, nothing wrapped, not planning or measuring.
    _trainer: Trainer | None = None
    _attached: Trainer | None = None
    _wrapped: tuple[_Wrapped, ...] = ()
    _planning = False
    _logged_plan = False
    _optimizer: torch.optim.Optimizer | None = None
    _accumulation = 1

    def attach(self, trainer: Trainer) -> BudgetCallback:
        """Plan on ``trainer`` (and add this callback to it if it is not there yet).

        For Trainers run where the callback cannot find them on the call stack.

        Example:
            >>> callback = BudgetCallback("2GiB").attach(trainer); trainer.train()
        """
        if not isinstance(trainer, Trainer):
            raise TypeError(f"attach() takes a transformers.Trainer, got {type(trainer).__name__}")
        self._attached = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.plan is not None:
            return  # train() called again on a planned model: the plan stays
        for wrapped in self._wrapped:  # left by a train() that raised before planning
            wrapped.undo()
        trainer = _calling_trainer() or self._attached
        if trainer is None:
            raise RuntimeError(
                "gradckpt.BudgetCallback could not find the Trainer that runs it on the call "
                "stack; attach it instead: BudgetCallback(budget).attach(trainer)"
            )
        self._trainer = trainer
        self._optimizer = torch_optimizer(kwargs.get("optimizer") or trainer.optimizer)
        self._accumulation = int(args.gradient_accumulation_steps)
        self._wrapped = (
            _Wrapped(trainer, "compute_loss", self._compute_loss(trainer.compute_loss)),
            _Wrapped(trainer, "training_step", self._guarded(trainer.training_step)),
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.report is None:
            return
        if not self._logged_plan:
            self._logged_plan = True
            r = self.report
            state.log_history.append(
                {
                    "gradckpt_budget_bytes": r.budget_bytes,
                    "gradckpt_predicted_peak_bytes": r.predicted_peak_bytes,
                    "gradckpt_baseline_peak_bytes": r.baseline_peak_bytes,
                    "gradckpt_predicted_overhead": r.predicted_overhead,
                    "step": state.global_step,
                }
            )
        if self._measuring is not None and state.global_step - self._first_step >= MEASURED_STEPS:
            self._finish_measuring(state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._measuring is not None:  # training ended before the second step
            self._finish_measuring(state)
        for wrapped in self._wrapped:
            wrapped.undo()
        self._wrapped = ()

    # ------------------------------------------------------------------ planning

    def _compute_loss(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def compute_loss(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            # The first training call: the batch exactly as the Trainer feeds it.
            # Evaluation (no_grad, eval mode) and calls while planning pass through.
            if (
                self.plan is None
                and not self._planning
                and model.training
                and torch.is_grad_enabled()
            ):
                self._plan(original, model, inputs, args, kwargs)
            return original(model, inputs, *args, **kwargs)

        return compute_loss

    def _plan(
        self,
        original: Callable[..., Any],
        model: nn.Module,
        inputs: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        trainer = self._trainer
        assert trainer is not None
        unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", None)
        target = unwrap(model) if callable(unwrap) else model

        def loss_fn() -> torch.Tensor:
            # compute_loss may pop from inputs (labels, with a label smoother): a copy each call.
            try:
                out = original(model, copy.copy(inputs), *args, **kwargs)
            except IndexError as exc:
                if "0-dim" not in str(exc):
                    raise
                raise ValueError(_NO_LOSS_IN_OUTPUT) from exc
            if isinstance(out, tuple):  # return_outputs=True: (loss, outputs)
                out = out[0]
            return self.loss_from(out)

        options = {
            "optimizer": self._optimizer,
            "accumulation_steps": self._accumulation,
            **self.plan_options,
        }
        others = _others(trainer, target)
        self._planning = True
        try:
            self.plan, self.report = fit_on_batch(
                target, loss_fn, self.budget, others=others, plan=self.ready_plan, **options
            )
        finally:
            self._planning = False
        measuring = StepsMeasurement(target, self._optimizer, others)  # what is real
        self._first_step = trainer.state.global_step
        if measuring.start():
            self._measuring = measuring

    def _guarded(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except BaseException:
                self._abort_measuring()
                raise

        return training_step

    def _finish_measuring(self, state: Any) -> None:
        steps = self._measured_steps(state.global_step)
        if steps is None:
            return
        state.log_history.append(
            {
                "gradckpt_budget_bytes": self.report.budget_bytes,
                "gradckpt_measured_peak_bytes": self.report.measured_peak_bytes,
                "gradckpt_measured_steps": steps,
                "step": state.global_step,
            }
        )
