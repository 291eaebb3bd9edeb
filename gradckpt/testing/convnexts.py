"""A ConvNeXt-shaped net (timm's ConvNeXt-atto by default): depthwise 7x7, LayerNorm, inverted MLP.

timm is not a dependency, so the shape is built here as timm lays it out:
``stem`` (4x4 stride-4 convolution, channels-first LayerNorm), then
``stages.{i}`` each with a ``downsample`` (LayerNorm, 2x2 stride-2 convolution;
none in the first) and ``blocks``: depthwise 7x7 convolution, LayerNorm over
channels (channels last), Linear to 4x the width, GELU, Linear back, a learned
per-channel scale, the residual. Depthwise convolutions take kernel workspace a
fake profile cannot see; the blocks are what block discovery finds.

Example:
    >>> ex = convnext(batch=2)
    >>> ex.block_paths[:2]
    ['stages.0.blocks.0', 'stages.0.blocks.1']
"""

from __future__ import annotations

import torch
from torch import nn

from gradckpt.testing.example import (
    Device,
    Example,
    build_example,
    classification_loss,
    labelled_inputs,
)

__all__ = ["ConvNeXt", "convnext"]


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (timm's ``LayerNorm2d``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Block(nn.Module):
    """dwconv 7x7 -> LayerNorm -> Linear(C, 4C) -> GELU -> Linear(4C, C) -> scale, + x."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        y = self.conv_dw(x).permute(0, 2, 3, 1)  # channels last: (B, H, W, C)
        y = self.fc2(self.act(self.fc1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class Stage(nn.Module):
    def __init__(self, c_in: int, c_out: int, depth: int, downsample: bool) -> None:
        super().__init__()
        self.downsample: nn.Module = nn.Identity()
        if downsample:
            self.downsample = nn.Sequential(LayerNorm2d(c_in, eps=1e-6), nn.Conv2d(c_in, c_out, 2, 2))
        self.blocks = nn.Sequential(*(Block(c_out) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class ConvNeXt(nn.Module):
    def __init__(self, depths: tuple[int, ...], dims: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6))
        self.stages = nn.Sequential(
            *(Stage(dims[max(0, i - 1)], dims[i], d, i > 0) for i, d in enumerate(depths))
        )
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes)
        x = self.stages(self.stem(x))
        return self.head(self.norm(x.mean((2, 3))))


def convnext(
    *,
    depths: tuple[int, ...] = (2, 2, 6, 2),
    dims: tuple[int, ...] = (40, 80, 160, 320),
    image: int = 224,
    batch: int = 4,
    classes: int = 1000,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """ConvNeXt; blocks are ``stages.{i}.blocks.{j}``. Defaults: ConvNeXt-atto at 224x224.

    Not in ``ZOO`` (a step takes a second on a CPU); tests and benchmarks build it here.

    >>> len(convnext(batch=1).block_paths)
    12
    """
    if len(depths) != len(dims):
        raise ValueError(f"depths {depths} and dims {dims} differ in length")
    return build_example(
        "convnext", seed, dtype, device,
        lambda: ConvNeXt(tuple(depths), tuple(dims), classes),
        lambda g: labelled_inputs(g, (batch, 3, image, image), classes),
        classification_loss,
        [f"stages.{i}.blocks.{j}" for i, d in enumerate(depths) for j in range(d)],
    )  # fmt: skip
