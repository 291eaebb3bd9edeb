"""``tune_training_args``: the Trainer's micro-batch, accumulation and plan, tuned to a budget.

The user's ``TrainingArguments`` fix the global batch per device and optimizer
step, ``per_device_train_batch_size * gradient_accumulation_steps``. This
splits it again: :func:`gradckpt.tune` tries every divisor as the micro-batch
(with no checkpointing, per-layer checkpointing and gradckpt's plan), in
whole-step bytes (optimizer state and accumulation counted), and keeps the one
measured fastest within the budget. The losses it runs come from the first
examples of the training set, put through the Trainer's collator as the
Trainer would (unused columns removed, on the model's device, under
``bf16``/``fp16`` autocast).

Returned: a copy of the arguments with the tuned ``per_device_train_batch_size``
and ``gradient_accumulation_steps`` (every other field equal), a
:class:`~gradckpt.integrations.hf.trainer.BudgetCallback` that applies the tuned
plan on the first step (no planning there) and measures the two steps after,
and the :class:`~gradckpt.tuning.TuneResult` (``print(result.table())``).

The plan is for the sequence length of those first examples: with padding to
the longest in each batch, use ``BudgetCallback(budget)`` with the tuned sizes
instead (it plans new shapes as they come).

Importing this module imports transformers (``gradckpt.integrations.hf``
re-exports ``tune_training_args`` lazily).

Example:
    >>> from gradckpt.integrations.hf import tune_training_args
    >>> args, callback, result = tune_training_args(model, args, data, budget="auto")
    >>> print(result.table())
    >>> Trainer(model, args, train_dataset=data, callbacks=[callback]).train()
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import itertools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import TrainingArguments, default_data_collator

from gradckpt.integrations.hf.trainer import BudgetCallback
from gradckpt.tuning import TuneResult, tune

__all__ = ["tune_training_args"]

#: What profiling a transformers model says once about use_cache (BudgetCallback handles it).
_CACHE_NOTICE = r"gradckpt: planned .* with use_cache=False"


def tune_training_args(
    model: nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    data_collator: Callable[[list[Any]], Any] | None = None,
    budget: int | str = "auto",
    *,
    optimizer: Any = "adamw",
    **tune_options: Any,
) -> tuple[TrainingArguments, BudgetCallback, TuneResult]:
    """Tune ``args``' micro-batch and accumulation, and the plan, for ``budget``.

    Args:
        model: the transformers model to train; moved to ``args.device`` first,
            as the Trainer moves it (unless it is spread by a ``device_map``).
        args: the Trainer's arguments; ``per_device_train_batch_size *
            gradient_accumulation_steps`` is the global batch, kept.
        train_dataset: indexable (``dataset[i]``) or iterable examples; the first
            ones make the micro-batches (repeated when there are fewer).
        data_collator: as given to the Trainer (default: transformers'
            ``default_data_collator``).
        budget: bytes, a string with units or ``"auto"`` (the device's memory):
            for the whole training step, as for :func:`gradckpt.tune`.
        optimizer: what the Trainer steps with, for its state and step (a name,
            an optimizer, or None: not counted); default AdamW, the Trainer's.
        **tune_options: passed to :func:`gradckpt.tune` (``batch_sizes``, ``top``,
            ``rounds``, ``blocks``).

    Returns:
        ``(args, callback, result)``: the tuned copy of ``args``, a ``BudgetCallback``
        applying ``result.plan`` on the first step, and the :class:`TuneResult`.

    Raises:
        BudgetError: no micro-batch size fits the budget with any plan.

    Example:
        >>> args, callback, result = tune_training_args(model, args, data, budget="12GiB")
        >>> Trainer(model, args, train_dataset=data, callbacks=[callback]).train()
    """
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"args must be transformers.TrainingArguments, got {type(args).__name__}")
    global_batch = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)
    _to_training_device(model, args)
    make_loss = _make_loss(model, args, train_dataset, data_collator or default_data_collator)
    was_training = model.training
    model.train()
    try:
        with warnings.catch_warnings():  # "train it so too": the callback turns the cache off
            warnings.filterwarnings("ignore", message=_CACHE_NOTICE)
            result = tune(model, make_loss, budget, optimizer=optimizer,
                          global_batch=global_batch, **tune_options)  # fmt: skip
    finally:
        model.train(was_training)
    tuned = _with_sizes(args, result.micro_batch, result.accumulation_steps)
    return tuned, BudgetCallback(result.budget_bytes, plan=result.plan), result


def _to_training_device(model: nn.Module, args: TrainingArguments) -> None:
    if getattr(model, "hf_device_map", None) or getattr(model, "is_quantized", False):
        return  # placed by its loader: the Trainer does not move it either
    devices = {p.device for p in model.parameters()}
    if len(devices) == 1 and devices != {args.device}:
        model.to(args.device)


def _with_sizes(args: TrainingArguments, micro_batch: int, accumulation: int) -> TrainingArguments:
    """A copy of ``args`` with the batch sizes changed, every other field as it was."""
    sizes = {
        "per_device_train_batch_size": micro_batch,
        "gradient_accumulation_steps": accumulation,
    }
    try:
        return dataclasses.replace(args, **sizes)
    except (TypeError, ValueError):  # a subclass whose __post_init__ refuses its own output
        tuned = copy.deepcopy(args)
        for name, value in sizes.items():
            setattr(tuned, name, value)
        return tuned


def _columns(model: nn.Module, args: TrainingArguments) -> set[str] | None:
    """The example keys the Trainer keeps (``remove_unused_columns``), None: all."""
    if not args.remove_unused_columns:
        return None
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {*params, "label", "label_ids", *(args.label_names or ())}


def _first_examples(dataset: Any, n: int) -> list[Any]:
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        count = min(len(dataset), n)
        examples = [dataset[i] for i in range(count)]
    else:
        examples = list(itertools.islice(iter(dataset), n))
    if not examples:
        raise ValueError("train_dataset is empty: tuning needs its first examples")
    return [examples[i % len(examples)] for i in range(n)]


def _make_loss(
    model: nn.Module, args: TrainingArguments, dataset: Any, collate: Callable[[list[Any]], Any]
) -> Callable[[int], Callable[[], torch.Tensor]]:
    keep = _columns(model, args)
    cache: dict[int, Any] = {}
    if args.bf16 or args.fp16:
        dtype = torch.bfloat16 if args.bf16 else torch.float16
    else:
        dtype = None

    def batch_of(b: int) -> Any:
        if b not in cache:
            examples = _first_examples(dataset, b)
            if keep is not None:
                examples = [
                    {k: v for k, v in e.items() if k in keep} if isinstance(e, Mapping) else e
                    for e in examples
                ]
            batch = collate(examples)
            if not isinstance(batch, Mapping):
                raise TypeError(
                    f"the data collator returned {type(batch).__name__}; tune_training_args "
                    "calls model(**batch), so it needs a dict of tensors"
                )
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            cache[b] = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                        for k, v in batch.items()}  # fmt: skip
        return cache[b]

    def make_loss(b: int) -> Callable[[], torch.Tensor]:
        batch = batch_of(b)

        def loss_fn() -> torch.Tensor:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            autocast = (
                torch.autocast(device.type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext()
            )  # fmt: skip
            with autocast:  # as the Trainer runs compute_loss
                return model(**batch).loss

        return loss_fn

    return make_loss
