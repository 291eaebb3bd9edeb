"""The registry of zoo models by name, and :func:`make` to build one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradckpt.testing.atrous import atrous
from gradckpt.testing.convnets import bn_convnet
from gradckpt.testing.example import Example
from gradckpt.testing.gpts import gpt
from gradckpt.testing.mlps import dropout_mlp, mlp
from gradckpt.testing.resnets import resnet
from gradckpt.testing.unets import unet

ZOO: dict[str, Callable[..., Example]] = {
    "mlp": mlp,
    "gpt": gpt,
    "resnet": resnet,
    "unet": unet,
    "dropout_mlp": dropout_mlp,
    "bn_convnet": bn_convnet,
    "atrous": atrous,
}


def make(name: str, **sizes: Any) -> Example:
    """Build the zoo model ``name`` with the given keyword sizes.

    >>> make("mlp", blocks=3, width=32).model.head.in_features
    32
    """
    if name not in ZOO:
        raise KeyError(f"unknown model {name!r}; choose from {sorted(ZOO)}")
    return ZOO[name](**sizes)
