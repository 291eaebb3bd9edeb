"""A RegNet-shaped conv net: blocks kept as attributes of plain stage modules, as timm does.

timm's RegNet holds its bottleneck blocks as ``stages.s1.b1``, ``b2``, ... : plain
attributes of plain ``RegStage`` modules, in no ``ModuleList``/``Sequential``.
Block discovery must still find each bottleneck (a stage of one block included),
and must not split a bottleneck into its three ``ConvNormAct`` parts.
"""

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


class ConvNormAct(nn.Module):
    """conv -> BatchNorm -> optional ReLU (timm's ConvNormAct)."""

    def __init__(
        self, c_in: int, c_out: int, k: int, stride: int = 1, groups: int = 1, act: bool = True
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, c_in, H, W) -> (B, c_out, H', W')
        x = self.bn(self.conv(x))
        return F.relu(x) if self.act else x


class SqueezeExcite(nn.Module):
    """Channel gating from the pooled features (RegNetY's SE)."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, reduced, 1)
        self.fc2 = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> same
        gate = self.fc2(F.relu(self.fc1(x.mean((2, 3), keepdim=True))))
        return x * gate.sigmoid()


class Bottleneck(nn.Module):
    """1x1 -> grouped 3x3 (stride) -> SE -> 1x1, plus a (downsampled) shortcut, then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int, group_width: int) -> None:
        super().__init__()
        self.conv1 = ConvNormAct(c_in, c_out, 1)
        self.conv2 = ConvNormAct(c_out, c_out, 3, stride, groups=c_out // group_width)
        self.se = SqueezeExcite(c_out, max(1, c_in // 4))
        self.conv3 = ConvNormAct(c_out, c_out, 1, act=False)
        self.downsample = (
            ConvNormAct(c_in, c_out, 1, stride, act=False) if stride != 1 or c_in != c_out else None
        )
        self.act3 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, c_in, H, W) -> (B, c_out, H/s, W/s)
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.act3(self.conv3(self.se(self.conv2(self.conv1(x)))) + shortcut)


class RegStage(nn.Module):
    """Blocks ``b1 .. b{depth}`` as plain attributes; the first one strides."""

    def __init__(self, c_in: int, c_out: int, depth: int, group_width: int) -> None:
        super().__init__()
        for i in range(depth):
            self.add_module(
                f"b{i + 1}",
                Bottleneck(c_in if i == 0 else c_out, c_out, 2 if i == 0 else 1, group_width),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.children():
            x = block(x)
        return x


class Stages(nn.Module):
    """Stages ``s1 .. s{n}`` as plain attributes (no ModuleList)."""

    def __init__(
        self, widths: tuple[int, ...], depths: tuple[int, ...], c_in: int, group_width: int
    ) -> None:
        super().__init__()
        for i, (width, depth) in enumerate(zip(widths, depths)):
            self.add_module(f"s{i + 1}", RegStage(c_in, width, depth, group_width))
            c_in = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.children():
            x = stage(x)
        return x


class RegNet(nn.Module):
    def __init__(
        self,
        widths: tuple[int, ...],
        depths: tuple[int, ...],
        stem: int,
        group_width: int,
        classes: int,
    ) -> None:
        super().__init__()
        self.stem = ConvNormAct(3, stem, 3, 2)
        self.stages = Stages(widths, depths, stem, group_width)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes)
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


def regnet(
    *,
    widths: tuple[int, ...] = (8, 16, 24, 32),
    depths: tuple[int, ...] = (1, 2, 3, 2),
    stem: int = 8,
    group_width: int = 8,
    image: int = 32,
    batch: int = 4,
    classes: int = 10,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """RegNet-shaped classifier; blocks are ``stages.s{i}.b{j}`` (plain attributes, not a list).

    >>> regnet().block_paths[:3]
    ['stages.s1.b1', 'stages.s2.b1', 'stages.s2.b2']
    """
    paths = [f"stages.s{i + 1}.b{j + 1}" for i, depth in enumerate(depths) for j in range(depth)]
    return build_example(
        "regnet", seed, dtype, device,
        lambda: RegNet(widths, depths, stem, group_width, classes),
        lambda g: labelled_inputs(g, (batch, 3, image, image), classes),
        classification_loss, paths,
    )  # fmt: skip
