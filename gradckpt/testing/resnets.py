"""CIFAR-style ResNets of basic blocks, including the conv-heavy one benchmarks use."""

from __future__ import annotations

import dataclasses

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


class BasicBlock(nn.Module):
    """ResNet basic block: relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))."""

    def __init__(self, c_in: int, c_out: int, stride: int, inplace_relu: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=inplace_relu)  # one module used twice, as in torchvision
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:  # 1x1 conv shortcut when the shape changes
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, c_in, H, W)
        out = self.relu(self.bn1(self.conv1(x)))  # (B, c_out, H/stride, W/stride)
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class ResNet(nn.Module):
    def __init__(
        self,
        stages: tuple[int, ...],
        channels: tuple[int, ...],
        classes: int,
        inplace: bool,
        imagenet_stem: bool = False,
    ) -> None:
        super().__init__()
        if imagenet_stem:  # torchvision's: 7x7 stride-2 conv, then 3x3 stride-2 max-pool (/4)
            self.stem = nn.Sequential(
                nn.Conv2d(3, channels[0], 7, 2, 3, bias=False),
                nn.BatchNorm2d(channels[0]),
                nn.ReLU(inplace=inplace),
                nn.MaxPool2d(3, 2, 1),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(3, channels[0], 3, 1, 1, bias=False),
                nn.BatchNorm2d(channels[0]),
                nn.ReLU(inplace=inplace),
            )
        # Stages are attributes layer1, layer2, ... (torchvision layout), not a container,
        # so discovery finds BasicBlocks (repeated children of each stage), not stages.
        self.stage_names = [f"layer{i + 1}" for i in range(len(stages))]
        c_prev = channels[0]
        for i, (n, c) in enumerate(zip(stages, channels)):
            stride = 1 if i == 0 else 2  # halve the resolution at the start of later stages
            blocks = [
                BasicBlock(c_prev if j == 0 else c, c, stride if j == 0 else 1, inplace)
                for j in range(n)
            ]
            self.add_module(self.stage_names[i], nn.Sequential(*blocks))
            c_prev = c
        self.fc = nn.Linear(c_prev, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W) -> (B, classes)
        x = self.stem(x)
        for name in self.stage_names:
            x = getattr(self, name)(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))  # pool to (B, C)


def resnet(
    *,
    stages: tuple[int, ...] = (2, 2),
    channels: tuple[int, ...] = (16, 32),
    image: int = 32,
    batch: int = 8,
    classes: int = 10,
    inplace_relu: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """CIFAR-style ResNet; blocks are ``layer1.0, layer1.1, layer2.0, ...``.

    ``inplace_relu=True`` uses in-place ReLUs like torchvision (a harder case for recompute).

    >>> resnet().block_paths
    ['layer1.0', 'layer1.1', 'layer2.0', 'layer2.1']
    """
    if len(stages) != len(channels):
        raise ValueError(f"stages {stages} and channels {channels} differ in length")
    return build_example(
        "resnet", seed, dtype, device,
        lambda: ResNet(tuple(stages), tuple(channels), classes, inplace_relu),
        lambda g: labelled_inputs(g, (batch, 3, image, image), classes),
        classification_loss, [f"layer{i + 1}.{j}" for i, n in enumerate(stages) for j in range(n)],
    )  # fmt: skip


def resnet_conv(
    *,
    stages: tuple[int, ...] = (2, 2, 2, 2),
    channels: tuple[int, ...] = (16, 32, 64, 128),
    image: int = 128,
    batch: int = 4,
    classes: int = 10,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """A conv-heavy ResNet at 128x128: 8 basic blocks (16 3x3 convolutions) by default.

    Convolution backward allocates large scratch buffers inside its kernel, so
    this is the model where the allocator's peak and the tensors' peak differ most.
    Not in ``ZOO``: a step takes about a second on a CPU, and the zoo's defaults
    are kept fast for the tests; benchmarks build it by name from here.

    >>> len(resnet_conv().block_paths)
    8
    """
    ex = resnet(
        stages=stages, channels=channels, image=image, batch=batch, classes=classes,
        seed=seed, dtype=dtype, device=device,
    )  # fmt: skip
    return dataclasses.replace(ex, name="resnet_conv")


def resnet_imagenet(
    *,
    stages: tuple[int, ...] = (2, 2, 2, 2),
    channels: tuple[int, ...] = (64, 128, 256, 512),
    image: int = 224,
    batch: int = 4,
    classes: int = 1000,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """ResNet-18's shape at 224x224 (torchvision's stem, four stages of two basic blocks).

    torchvision is not a dependency, so the shape is built here: 11.7 M parameters, the
    stem's 7x7 convolution and max-pool at full resolution. Not in ``ZOO`` (a step takes
    seconds on a CPU); benchmarks and the slower tests build it by name from here.

    >>> resnet_imagenet(batch=1).block_paths[:2]
    ['layer1.0', 'layer1.1']
    """
    ex = build_example(
        "resnet", seed, dtype, device,
        lambda: ResNet(tuple(stages), tuple(channels), classes, False, imagenet_stem=True),
        lambda g: labelled_inputs(g, (batch, 3, image, image), classes),
        classification_loss, [f"layer{i + 1}.{j}" for i, n in enumerate(stages) for j in range(n)],
    )  # fmt: skip
    return dataclasses.replace(ex, name="resnet_imagenet")
