"""Small diffusers U-Nets built from configs (random weights, nothing downloaded).

Shared by the diffusers tests and ``benchmarks/hf_models.py``: :func:`unet_example`
builds a ``UNet2DModel`` (pixel space, self-attention in the middle resolutions)
or a ``UNet2DConditionModel`` (latent space, cross-attention to a text-like
context) with a fixed noisy batch, and a ``loss_fn`` that is the usual
noise-prediction MSE. Importing this module imports diffusers.

Example:
    >>> ex = unet_example("unet2d", sample=32)
    >>> plan = gradckpt.fit(ex.model, ex.loss_fn, budget=0.6)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel, UNet2DModel
from torch import nn

from gradckpt.profiling.units import find_blocks
from gradckpt.testing import Example

__all__ = ["UNETS", "unet_example"]

UNETS = ("unet2d", "unet2d_condition")


def _unet2d(s: dict[str, Any]) -> nn.Module:
    # Self-attention only at the lowest resolution (and in the mid block), as pixel-space
    # DDPM U-Nets do: at 512x512 an attention two levels up would span 65536 positions.
    n = len(s["channels"])
    return UNet2DModel(
        sample_size=s["sample"], in_channels=3, out_channels=3,
        layers_per_block=s["layers_per_block"], block_out_channels=s["channels"],
        down_block_types=("DownBlock2D",) * (n - 1) + ("AttnDownBlock2D",),
        up_block_types=("AttnUpBlock2D",) + ("UpBlock2D",) * (n - 1),
        norm_num_groups=s["groups"], attention_head_dim=s["head_dim"], dropout=s["dropout"],
    )  # fmt: skip


def _unet2d_condition(s: dict[str, Any]) -> nn.Module:
    n = len(s["channels"])
    return UNet2DConditionModel(
        sample_size=s["sample"], in_channels=4, out_channels=4,
        layers_per_block=s["layers_per_block"], block_out_channels=s["channels"],
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        cross_attention_dim=s["context_dim"], norm_num_groups=s["groups"],
        attention_head_dim=s["head_dim"], dropout=s["dropout"],
    )  # fmt: skip


def unet_example(
    name: str,
    *,
    sample: int = 32,
    batch: int = 2,
    channels: tuple[int, ...] = (32, 64, 64),
    layers_per_block: int = 1,
    groups: int = 8,
    head_dim: int = 8,
    context_dim: int = 32,
    context_len: int = 8,
    dropout: float = 0.1,
    seed: int = 0,
    autocast: torch.dtype | None = None,
) -> Example:
    """A diffusers U-Net from a small config, a fixed noisy batch and its denoising loss.

    Args:
        name: "unet2d" (pixels, 3 channels) or "unet2d_condition" (latents, 4
            channels, cross-attention to a ``(batch, context_len, context_dim)`` context).
        sample: height and width of the pixels or latents.
        channels: ``block_out_channels``; one down and one up block per entry.
        layers_per_block, groups, head_dim: the config's sizes.
        dropout: the resnets' dropout (on: gradients are compared with RNG replay).
        seed: weights from this seed; the batch from a private generator.
        autocast: run the forward under CPU/CUDA autocast with this dtype.

    Example:
        >>> unet_example("unet2d_condition", sample=16).block_paths[:2]
        ['down_blocks.0.attentions.0', 'down_blocks.0.resnets.0']
    """
    builders = {"unet2d": _unet2d, "unet2d_condition": _unet2d_condition}
    if name not in builders:
        raise ValueError(f"unknown U-Net {name!r}; choose from {UNETS}")
    sizes = dict(
        sample=sample, channels=tuple(channels), layers_per_block=layers_per_block,
        groups=groups, head_dim=head_dim, context_dim=context_dim, dropout=dropout,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = builders[name](sizes).train()
    g = torch.Generator().manual_seed(seed + 1_000_003)
    c_in = model.config.in_channels
    inputs: dict[str, torch.Tensor] = {
        "sample": torch.randn(batch, c_in, sample, sample, generator=g),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "noise": torch.randn(batch, c_in, sample, sample, generator=g),
    }
    if name == "unet2d_condition":
        inputs["encoder_hidden_states"] = torch.randn(batch, context_len, context_dim, generator=g)
    device_type = next(model.parameters()).device.type

    def loss_fn() -> torch.Tensor:
        ctx = (
            torch.autocast(device_type, dtype=autocast)
            if autocast is not None
            else contextlib.nullcontext()
        )
        kwargs = {k: v for k, v in inputs.items() if k != "noise"}
        with ctx:
            prediction = model(**kwargs).sample
        return F.mse_loss(prediction.float(), inputs["noise"])

    return Example(name, model, loss_fn, inputs, find_blocks(model))
