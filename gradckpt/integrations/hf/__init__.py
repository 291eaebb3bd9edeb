"""Hugging Face transformers: plan a transformers model, or use its own switch with gradckpt.

Two ways in, both on models from ``transformers`` (optional extra ``hf``):

1. **Planned**: ``gradckpt.fit(model, loss_fn, budget)`` works on a transformers
   model as on any other. Its decoder/encoder layers (``GradientCheckpointingLayer``)
   are the blocks; embeddings, rotary tables, final norm and head are planned
   units too. While profiling, the KV cache is off (``use_cache=False``) and
   transformers' own checkpointing, if on, is paused; ``fit`` leaves both off
   for training and says so once (:func:`training`). The cache is kept off by
   passing ``use_cache=False`` to training forwards, not by editing the config
   (so ``save_pretrained`` writes the user's value); ``gradckpt.remove`` ends it.
2. **The usual switch**: :func:`enable` turns on transformers' per-layer
   checkpointing with ``gradckpt.checkpoint`` (and an optional per-op policy)
   instead of ``torch.utils.checkpoint``; :func:`disable` undoes it.

Why ``use_cache`` must be off for training: a layer recomputed in backward calls
``cache.update`` a second time, so the KV cache grows by a second copy of every
recomputed layer's keys and values (memory the plan did not count). Generation
is unaffected: ``generate()`` passes ``generation_config.use_cache`` explicitly.

This package does not import ``transformers``: it recognizes its classes by the
module they come from, so ``import gradckpt`` stays light. Its modules: the
switch (``switch``), recognizing models (``recognize``), the KV cache
(``cache``), what the adapter does around profiling and ``fit`` (``adapter``),
the one-time messages (``notices``), the ``Trainer`` callback (``trainer``),
picking its micro-batch (``tune``) and small models from configs (``zoo``).

Example:
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> from gradckpt.integrations import hf
    >>> model = GPT2LMHeadModel(GPT2Config(n_layer=4)).train()
    >>> plan = gradckpt.fit(model, lambda: model(input_ids=ids, labels=ids).loss, budget=0.6)
    >>> # or, keeping transformers' one-checkpoint-per-layer placement:
    >>> hf.enable(other_model, policy=gradckpt.policies.save_matmuls)

See ``examples/hf_finetune.py`` for both, with a frozen base and LoRA adapters.
For the ``Trainer``: ``BudgetCallback(budget)`` plans its step on the first batch
(``hf.trainer``), and ``tune_training_args(model, args, data, budget=...)`` picks
the micro-batch and accumulation for the arguments' global batch and the plan
with them (``hf.tune``); both import transformers, so are loaded on first use.
"""

from __future__ import annotations

from typing import Any

from gradckpt.integrations.hf.adapter import fake_friendly, planning, training
from gradckpt.integrations.hf.cache import disable_cache
from gradckpt.integrations.hf.recognize import is_hf_model
from gradckpt.integrations.hf.switch import checkpoint_function, disable, enable

__all__ = [
    "BudgetCallback",
    "checkpoint_function",
    "disable",
    "disable_cache",
    "enable",
    "fake_friendly",
    "is_hf_model",
    "planning",
    "training",
    "tune_training_args",
]


def __getattr__(name: str) -> Any:  # these import transformers: load them on first use
    if name == "BudgetCallback":
        from gradckpt.integrations.hf.trainer import BudgetCallback

        return BudgetCallback
    if name == "tune_training_args":
        from gradckpt.integrations.hf.tune import tune_training_args

        return tune_training_args
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
