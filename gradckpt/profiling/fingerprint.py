"""A short hash of a model's structure, so a plan is never applied to another model."""

from __future__ import annotations

import hashlib

from torch import nn

__all__ = ["model_fingerprint"]


def model_fingerprint(model: nn.Module) -> str:
    """Hash of module paths and classes and of parameter/buffer names, shapes and dtypes.

    Weights' values do not enter: a plan stays valid across training steps.

    Example:
        >>> model_fingerprint(nn.Linear(4, 2)) == model_fingerprint(nn.Linear(4, 2))
        True
    """
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"m:{name}:{type(module).__qualname__};".encode())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"t:{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()[:16]
