"""Recognizing transformers models without importing transformers.

A model cannot hold transformers classes unless transformers was imported
already, so the check reads ``sys.modules`` and class modules only; this keeps
``import gradckpt`` light.
"""

from __future__ import annotations

import sys

from torch import nn


def from_transformers(cls: type) -> bool:
    """Whether ``cls`` or one of its bases is defined in the transformers package."""
    return any(c.__module__.partition(".")[0] == "transformers" for c in cls.__mro__)


def is_hf_model(model: nn.Module) -> bool:
    """True if ``model`` is, or holds, a module whose class comes from transformers.

    Never imports transformers: a model cannot hold transformers classes unless
    transformers was imported already.

    Example:
        >>> is_hf_model(GPT2LMHeadModel(GPT2Config()))
        True
    """
    if "transformers" not in sys.modules:
        return False
    return any(from_transformers(type(m)) for m in model.modules())


def model_name(model: nn.Module) -> str:
    """The model's class name, as messages show it."""
    return type(model).__name__
