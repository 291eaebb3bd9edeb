"""A DeepLabV3-shaped segmenter: dilated residual blocks, then atrous spatial pyramid pooling.

Its dilated convolutions (rates 12 and 18 in the pyramid) are what makes it a
test model: on CPU their backward runs oneDNN kernels that take buffers from
malloc without an allocator event (``gradckpt.measure.outside``), so a plan
that counts only the allocator runs over its budget at malloc level.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradckpt.testing.example import Device, Example, Inputs, build_example


def _conv_bn_relu(c_in: int, c_out: int, kernel: int = 3, dilation: int = 1) -> nn.Sequential:
    pad = dilation * (kernel // 2)
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, padding=pad, dilation=dilation, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class DilatedBlock(nn.Module):
    """Residual pair of 3x3 convs at one dilation (DeepLab's later backbone stages)."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.first = _conv_bn_relu(channels, channels, dilation=dilation)
        self.conv = nn.Conv2d(
            channels, channels, 3, padding=dilation, dilation=dilation, bias=False
        )
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, h, w) -> same
        return F.relu(x + self.bn(self.conv(self.first(x))))


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling: 1x1, three dilated 3x3s and a pooled branch, fused."""

    def __init__(self, c_in: int, c_out: int, rates: tuple[int, ...] = (6, 12, 18)) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            [_conv_bn_relu(c_in, c_out, kernel=1)]
            + [_conv_bn_relu(c_in, c_out, dilation=r) for r in rates]
        )
        self.pooled = _conv_bn_relu(c_in, c_out, kernel=1)
        self.project = _conv_bn_relu(c_out * (len(rates) + 2), c_out, kernel=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, c_in, h, w) -> (B, c_out, h, w)
        pooled = self.pooled(F.adaptive_avg_pool2d(x, 1)).expand(-1, -1, *x.shape[-2:])
        return self.project(torch.cat([b(x) for b in self.branches] + [pooled], dim=1))


class AtrousNet(nn.Module):
    def __init__(self, blocks: int, channels: int, classes: int) -> None:
        super().__init__()
        # Output stride 4: two strided convs, then full-resolution dilated blocks.
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
        self.blocks = nn.ModuleList(DilatedBlock(channels, 2) for _ in range(blocks))
        self.aspp = ASPP(channels, channels)
        self.head = nn.Conv2d(channels, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes, H, W)
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.aspp(h))
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def _segment(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    return F.cross_entropy(model(inputs["x"]), inputs["y"])


def atrous(
    *,
    blocks: int = 3,
    channels: int = 32,
    image: int = 64,
    batch: int = 2,
    classes: int = 5,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """DeepLab-shaped segmenter; blocks are ``blocks.0 .. blocks.{blocks-1}``.

    >>> atrous(blocks=2).block_paths
    ['blocks.0', 'blocks.1']
    """
    shape = (batch, 3, image, image)
    return build_example(
        "atrous", seed, dtype, device,
        lambda: AtrousNet(blocks, channels, classes),
        lambda g: {
            "x": torch.randn(shape, generator=g),
            "y": torch.randint(0, classes, (batch, image, image), generator=g),
        },
        _segment, [f"blocks.{i}" for i in range(blocks)],
    )  # fmt: skip
