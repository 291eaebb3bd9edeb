"""A U-Net: two block classes and skips that cross blocks, so the model is not a chain."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradckpt.testing.example import Device, Example, Inputs, build_example


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1),
        nn.ReLU(),
    )


class DownBlock(nn.Module):
    """[maxpool 2x2] then two conv3x3+ReLU. Its output is both the skip and the next input.

    Pooling at the start (not the end) keeps every block tensor -> tensor; the first
    encoder block does not pool and the bottleneck does the last encoder block's pooling.
    """

    def __init__(self, c_in: int, c_out: int, pool: bool) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()
        self.conv = _double_conv(c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, c_in, H, W) -> (B, c_out, H', W')
        return self.conv(self.pool(x))


class UpBlock(nn.Module):
    """Transposed conv 2x up, concat with the encoder skip, two conv3x3+ReLU."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.conv = _double_conv(2 * c_out, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)  # (B, c_in, H, W) -> (B, c_out, 2H, 2W), the skip's shape
        return self.conv(torch.cat([x, skip], dim=1))  # concat: (B, 2*c_out, 2H, 2W)


class UNet(nn.Module):
    def __init__(self, depth: int, base: int, c_io: int) -> None:
        super().__init__()
        widths = [base * 2**i for i in range(depth + 1)]  # channels per level, bottleneck last
        self.down = nn.ModuleList(
            DownBlock(c_io if i == 0 else widths[i - 1], widths[i], pool=i > 0)
            for i in range(depth)
        )
        self.bottleneck = DownBlock(widths[depth - 1], widths[depth], pool=True)
        self.up = nn.ModuleList(UpBlock(widths[i + 1], widths[i]) for i in reversed(range(depth)))
        self.out = nn.Conv2d(base, c_io, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 3, H, W)
        skips: list[torch.Tensor] = []  # live from their encoder block until their decoder block
        for block in self.down:
            x = block(x)
            skips.append(x)
        x = self.bottleneck(x)  # (B, base*2**depth, H/2**depth, W/2**depth)
        for block in self.up:
            x = block(x, skips.pop())  # deepest skip first
        return self.out(x)


def _regress(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    return F.mse_loss(model(inputs["x"]), inputs["target"])


def unet(
    *,
    depth: int = 3,
    base: int = 8,
    image: int = 32,
    batch: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """U-Net; blocks are ``down.0 .. down.{depth-1}`` (DownBlock) then ``up.0 ..`` (UpBlock).

    Two block classes, and skips that cross blocks: the model is not a chain.

    >>> unet(depth=2).block_paths
    ['down.0', 'down.1', 'up.0', 'up.1']
    """
    if image % 2**depth:
        raise ValueError(f"image={image} is not divisible by 2**depth={2**depth}")
    shape = (batch, 3, image, image)
    return build_example(
        "unet", seed, dtype, device,
        lambda: UNet(depth, base, 3),
        lambda g: {"x": torch.randn(shape, generator=g), "target": torch.randn(shape, generator=g)},
        _regress, [f"down.{i}" for i in range(depth)] + [f"up.{i}" for i in range(depth)],
    )  # fmt: skip
