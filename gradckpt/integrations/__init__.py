"""Layer 7: integrations with other libraries (Hugging Face transformers, ...).

Nothing heavy is imported here: ``gradckpt.plan``/``fit`` call :func:`preparing`
and :func:`training`, which look at the model's classes and only then load the
integration that fits (``gradckpt.integrations.hf`` never imports transformers
itself; it recognizes its classes by module name).

Example:
    >>> from gradckpt.integrations import hf
    >>> hf.enable(model, policy=gradckpt.policies.save_matmuls)
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

from torch import nn

from gradckpt.integrations import diffusers_unet
from gradckpt.profile.units import register_block_finder

__all__ = ["preparing", "training"]

# Block finders for libraries whose blocks the generic rules miss (none imports its library).
register_block_finder(diffusers_unet.unet_blocks)


def preparing(model: nn.Module, *, fake: bool = False) -> AbstractContextManager[None]:
    """The context to profile ``model`` in (for transformers: no KV cache; under fake
    tensors, its real-data branches); else a no-op.

    Example:
        >>> with preparing(model):
        ...     prof = gradckpt.profile(model, loss_fn)
    """
    from gradckpt.integrations import hf

    if not hf.is_hf_model(model):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(hf.planning(model))
    if fake:
        stack.enter_context(hf.fake_friendly())
    return stack


def training(model: nn.Module) -> AbstractContextManager[None]:
    """The context ``gradckpt.fit`` plans and applies in; its settings stay for training.

    Example:
        >>> with training(model):
        ...     gradckpt.apply(model, plan)
    """
    from gradckpt.integrations import hf

    if hf.is_hf_model(model):
        return hf.training(model)
    return contextlib.nullcontext()
