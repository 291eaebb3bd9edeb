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

# One module per model family; this package re-exports every public name so that
# ``from gradckpt.testing import make, Example, GPT, ...`` works as it always has.
# The factories and ``make`` are the zoo's interface; the model classes are here
# for tests and examples that build or subclass them directly.
from gradckpt.testing.atrous import ASPP, AtrousNet, DilatedBlock, atrous
from gradckpt.testing.convnets import BNConvNet, ConvBNReLU, bn_convnet
from gradckpt.testing.convnexts import ConvNeXt, convnext
from gradckpt.testing.example import Example
from gradckpt.testing.gpts import GPT, CausalSelfAttention, FeedForward, GPTBlock, gpt
from gradckpt.testing.mlps import MLP, ResidualMLPBlock, dropout_mlp, mlp
from gradckpt.testing.resnets import BasicBlock, ResNet, resnet, resnet_conv, resnet_imagenet
from gradckpt.testing.unets import DownBlock, UNet, UpBlock, unet
from gradckpt.testing.wild import WILD, wild
from gradckpt.testing.zoo import ZOO, make

__all__ = [
    "ASPP",
    "GPT",
    "MLP",
    "WILD",
    "ZOO",
    "AtrousNet",
    "BNConvNet",
    "BasicBlock",
    "CausalSelfAttention",
    "ConvBNReLU",
    "ConvNeXt",
    "DilatedBlock",
    "DownBlock",
    "Example",
    "FeedForward",
    "GPTBlock",
    "ResNet",
    "ResidualMLPBlock",
    "UNet",
    "UpBlock",
    "atrous",
    "bn_convnet",
    "convnext",
    "dropout_mlp",
    "gpt",
    "make",
    "mlp",
    "resnet",
    "resnet_conv",
    "resnet_imagenet",
    "unet",
    "wild",
]
