"""A chain of conv-BatchNorm-ReLU blocks: running stats that recompute must not update twice."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradckpt.testing.example import (
    Device,
    Example,
    build_example,
    classification_loss,
    labelled_inputs,
)


class ConvBNReLU(nn.Module):
    """conv3x3 -> BatchNorm -> ReLU: running stats must update once per step, not per recompute."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, c_in, H, W) -> (B, c_out, H, W)
        return F.relu(self.bn(self.conv(x)))


class BNConvNet(nn.Module):
    def __init__(self, blocks: int, channels: int, classes: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(ConvBNReLU(3 if i == 0 else channels, channels) for i in range(blocks))
        )
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes)
        return self.fc(F.adaptive_avg_pool2d(self.blocks(x), 1).flatten(1))


def bn_convnet(
    *,
    blocks: int = 4,
    channels: int = 16,
    image: int = 16,
    batch: int = 8,
    classes: int = 10,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """Chain of conv-BN-ReLU blocks; blocks are ``blocks.0 .. blocks.{blocks-1}``.

    >>> bn_convnet(blocks=2).model.blocks[0].bn.num_batches_tracked.item()
    0
    """
    return build_example(
        "bn_convnet", seed, dtype, device,
        lambda: BNConvNet(blocks, channels, classes),
        lambda g: labelled_inputs(g, (batch, 3, image, image), classes),
        classification_loss, [f"blocks.{i}" for i in range(blocks)],
    )  # fmt: skip
