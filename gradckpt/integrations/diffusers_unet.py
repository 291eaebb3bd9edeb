"""diffusers U-Nets: which modules are the blocks (without importing diffusers).

A diffusers U-Net (``UNet2DModel``, ``UNet2DConditionModel``, the VAE's encoder
and decoder) is ``down_blocks``, a ``mid_block`` and ``up_blocks``; each holds
``resnets``, ``attentions`` and ``downsamplers``/``upsamplers`` lists. The
members of those lists are the units a plan checkpoints: they are the layers
the resolution changes between, and the down blocks' resnet outputs are the
skip tensors the up blocks read much later (the profiler sees those tensors
kept alive across the middle of the network, so the plan counts them).

The generic rule (repeated classes) picks the wrong grain here: the GELU
projection inside a cross-attention's feed-forward repeats too, and being
innermost it would hide the attention modules themselves. So
:func:`unet_blocks` is registered as a block finder (``gradckpt.integrations``
does it on import); it recognizes diffusers classes by their module name.

Example:
    >>> unet_blocks(UNet2DModel(...))[:3]
    ['down_blocks.0.resnets.0', 'down_blocks.0.downsamplers.0', 'down_blocks.1.resnets.0']
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["LISTS", "is_diffusers_model", "unet_blocks"]

# The lists inside a diffusers down/mid/up block whose members are units.
LISTS = frozenset({"resnets", "attentions", "downsamplers", "upsamplers"})


def _from_diffusers(module: nn.Module) -> bool:
    return type(module).__module__.partition(".")[0] == "diffusers"


def is_diffusers_model(model: nn.Module) -> bool:
    """True if ``model`` holds a module whose class comes from diffusers (never imports it).

    Example:
        >>> is_diffusers_model(nn.Linear(2, 2))
        False
    """
    return "diffusers" in sys.modules and any(_from_diffusers(m) for m in model.modules())


def unet_blocks(model: nn.Module) -> list[str]:
    """Paths of the members of every diffusers block's resnets/attentions/samplers lists.

    Returns [] for a model without diffusers blocks (discovery then goes on to
    its generic rules). Found inside any wrapper (a PEFT model, a training module).

    Example:
        >>> unet_blocks(unet)
        ['down_blocks.0.resnets.0', ..., 'up_blocks.2.resnets.2']
    """
    if not is_diffusers_model(model):
        return []
    found = []
    for path, module in model.named_modules():
        if not _from_diffusers(module):
            continue
        for list_name, members in module.named_children():
            if list_name in LISTS and isinstance(members, nn.ModuleList):
                prefix = f"{path}.{list_name}" if path else list_name
                found.extend(f"{prefix}.{name}" for name, _ in members.named_children())
    return found
