"""A zoo of tiny, deterministic models shared by tests, benchmarks and the demo.

Each factory returns an :class:`Example`: a model in train mode, a fixed batch, a
zero-argument ``loss_fn`` that runs one forward on that batch, and the qualified
names of the model's repeated blocks (what block discovery should find). Sizes
are keyword-only with small defaults (forward+backward in tens of milliseconds
on a laptop CPU); benchmarks pass bigger ones. ``seed`` fixes weights and data,
and building an example never touches the caller's global RNG state.

>>> ex = make("gpt", layers=2)
>>> ex.loss_fn().backward()
>>> ex.block_paths
['blocks.0', 'blocks.1']

Dropout draws from the global RNG when ``loss_fn`` runs, so seed it to compare
two runs: ``torch.manual_seed(0); ex.loss_fn()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ZOO",
    "Example",
    "bn_convnet",
    "dropout_mlp",
    "gpt",
    "make",
    "mlp",
    "resnet",
    "resnet_conv",
    "unet",
]

Device = torch.device | str


@dataclass(frozen=True)
class Example:
    """A model, a fixed batch and a zero-argument loss over that batch."""

    name: str
    model: nn.Module = field(repr=False)
    loss_fn: Callable[[], torch.Tensor] = field(repr=False)  # one forward -> scalar loss
    inputs: dict[str, torch.Tensor] = field(repr=False)  # the batch loss_fn uses
    block_paths: list[str]  # qualified names of the repeated blocks, in forward order


Inputs = dict[str, torch.Tensor]


def _example(
    name: str,
    seed: int,
    dtype: torch.dtype,
    device: Device,
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[torch.Generator], Inputs],
    loss: Callable[[nn.Module, Inputs], torch.Tensor],
    block_paths: list[str],
) -> Example:
    """Build model and batch from ``seed`` on CPU, move them, and close ``loss`` over them."""
    with torch.random.fork_rng(devices=[]):  # module inits use the global RNG: save and restore it
        torch.manual_seed(seed)
        model = make_model().train().to(device=device, dtype=dtype)
    # The batch comes from a private generator, so it does not depend on how many
    # random numbers the weight init consumed (i.e. on the model's sizes).
    raw = make_inputs(torch.Generator().manual_seed(seed + 1_000_003))
    inputs = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in raw.items()}
    return Example(name, model, lambda: loss(model, inputs), inputs, block_paths)


def _labelled(g: torch.Generator, x_shape: tuple[int, ...], classes: int) -> Inputs:
    """Random inputs of ``x_shape`` (batch first) and integer class labels."""
    x = torch.randn(x_shape, generator=g)
    return {"x": x, "y": torch.randint(0, classes, x_shape[:1], generator=g)}


def _classify(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    return F.cross_entropy(model(inputs["x"]), inputs["y"])


# --------------------------------------------------------------------------- mlp


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
    return _example(
        "mlp", seed, dtype, device,
        lambda: MLP(blocks, width, hidden, classes, dropout),
        lambda g: _labelled(g, (batch, width), classes),
        _classify, [f"blocks.{i}" for i in range(blocks)],
    )  # fmt: skip


def dropout_mlp(**kw: Any) -> Example:
    """:func:`mlp` with ``dropout=0.2``: a block that draws random numbers, so RNG replay matters."""
    return dataclasses.replace(mlp(**{"dropout": 0.2, **kw}), name="dropout_mlp")


# --------------------------------------------------------------------------- gpt


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)  # fused q, k, v projection
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        # (B, H, T, C/H). With dropout_p > 0 on CPU this takes the math path, which
        # materialises (B, H, T, T) scores; the flash kernel is used when dropout is off.
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C), a copy: heads back side by side
        return self.resid_drop(self.proj(y))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        return self.drop(self.proj(self.act(self.fc(x))))  # hidden (B, T, 4C)


class GPTBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, layers: int, d_model: int, heads: int, seq: int, vocab: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq, d_model)
        self.drop = nn.Dropout(dropout)  # embedding dropout: an RNG draw before the first block
        self.blocks = nn.ModuleList(GPTBlock(d_model, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        for m in self.modules():  # GPT-2 init; N(0, 1) embeddings would give huge tied logits
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        self.lm_head.weight = self.tok_emb.weight  # tied: one (vocab, C) parameter, two uses

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, T) -> logits (B, T, vocab)
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _next_token_loss(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    logits = model(inputs["idx"])  # (B, T, V)
    # targets are the inputs shifted by one, stored contiguous so the view costs nothing
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), inputs["targets"].view(-1))


def gpt(
    *,
    layers: int = 4,
    d_model: int = 64,
    heads: int = 4,
    seq: int = 64,
    vocab: int = 4096,
    batch: int = 4,
    dropout: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Device = "cpu",
) -> Example:
    """GPT-2-like decoder with tied embeddings; blocks are ``blocks.0 .. blocks.{layers-1}``.

    The default vocabulary makes the logits (B*T*vocab) outweigh one block's saved
    activations, so the head and the loss matter for the peak, as in real LMs.

    >>> gpt(layers=2).inputs["idx"].shape
    torch.Size([4, 64])
    """
    if d_model % heads:
        raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")

    def tokens(g: torch.Generator) -> Inputs:
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)  # (B, T+1)
        return {"idx": t[:, :-1].contiguous(), "targets": t[:, 1:].contiguous()}

    return _example(
        "gpt", seed, dtype, device,
        lambda: GPT(layers, d_model, heads, seq, vocab, dropout),
        tokens, _next_token_loss, [f"blocks.{i}" for i in range(layers)],
    )  # fmt: skip


# --------------------------------------------------------------------------- resnet


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
        self, stages: tuple[int, ...], channels: tuple[int, ...], classes: int, inplace: bool
    ) -> None:
        super().__init__()
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
    return _example(
        "resnet", seed, dtype, device,
        lambda: ResNet(tuple(stages), tuple(channels), classes, inplace_relu),
        lambda g: _labelled(g, (batch, 3, image, image), classes),
        _classify, [f"layer{i + 1}.{j}" for i, n in enumerate(stages) for j in range(n)],
    )  # fmt: skip


# --------------------------------------------------------------------------- unet


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
    return _example(
        "unet", seed, dtype, device,
        lambda: UNet(depth, base, 3),
        lambda g: {"x": torch.randn(shape, generator=g), "target": torch.randn(shape, generator=g)},
        _regress, [f"down.{i}" for i in range(depth)] + [f"up.{i}" for i in range(depth)],
    )  # fmt: skip


# --------------------------------------------------------------------------- bn_convnet


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
    return _example(
        "bn_convnet", seed, dtype, device,
        lambda: BNConvNet(blocks, channels, classes),
        lambda g: _labelled(g, (batch, 3, image, image), classes),
        _classify, [f"blocks.{i}" for i in range(blocks)],
    )  # fmt: skip


# --------------------------------------------------------------------------- resnet_conv


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


# --------------------------------------------------------------------------- registry

ZOO: dict[str, Callable[..., Example]] = {
    "mlp": mlp,
    "gpt": gpt,
    "resnet": resnet,
    "unet": unet,
    "dropout_mlp": dropout_mlp,
    "bn_convnet": bn_convnet,
}


def make(name: str, **sizes: Any) -> Example:
    """Build the zoo model ``name`` with the given keyword sizes.

    >>> make("mlp", blocks=3, width=32).model.head.in_features
    32
    """
    if name not in ZOO:
        raise KeyError(f"unknown model {name!r}; choose from {sorted(ZOO)}")
    return ZOO[name](**sizes)
