"""Residual MLP classifiers: the simplest chain of identical blocks, with and without dropout."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from gradckpt.testing.example import (
    Device,
    Example,
    build_example,
    classification_loss,
    labelled_inputs,
)


class ResidualMLPBlock(nn.Module):
    """x + Linear(Dropout(GELU(Linear(LayerNorm(x))))): a transformer MLP without attention."""

    def __init__(self, width: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        # Identity when off, so a dropout-free block draws no random numbers at all.
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, width)
        h = self.drop(self.act(self.fc1(self.norm(x))))  # (B, hidden)
        return x + self.fc2(h)  # (B, width)


class MLP(nn.Module):
    def __init__(self, blocks: int, width: int, hidden: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(ResidualMLPBlock(width, hidden, dropout) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, width) -> logits (B, classes)
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp(
    *,
    blocks: int = 6,
    width: int = 128,
    hidden: int = 512,
    batch: int = 64,
    classes: int = 10,
    dropout: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """Residual MLP classifier; blocks are ``blocks.0 .. blocks.{blocks-1}``.

    >>> mlp(blocks=2).block_paths
    ['blocks.0', 'blocks.1']
    """
    return build_example(
        "mlp", seed, dtype, device,
        lambda: MLP(blocks, width, hidden, classes, dropout),
        lambda g: labelled_inputs(g, (batch, width), classes),
        classification_loss, [f"blocks.{i}" for i in range(blocks)],
    )  # fmt: skip


def dropout_mlp(**kw: Any) -> Example:
    """:func:`mlp` with ``dropout=0.2``: a block that draws random numbers, so RNG replay matters."""
    return dataclasses.replace(mlp(**{"dropout": 0.2, **kw}), name="dropout_mlp")
