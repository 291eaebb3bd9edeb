"""What every zoo model is handed back as, and the builder all factories share.

An :class:`Example` bundles a model in train mode, a fixed batch, a zero-argument
``loss_fn`` and the qualified names of the repeated blocks. :func:`build_example`
builds model and batch from a seed without touching the caller's global RNG.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

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


def build_example(
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


def labelled_inputs(g: torch.Generator, x_shape: tuple[int, ...], classes: int) -> Inputs:
    """Random inputs of ``x_shape`` (batch first) and integer class labels."""
    x = torch.randn(x_shape, generator=g)
    return {"x": x, "y": torch.randint(0, classes, x_shape[:1], generator=g)}


def classification_loss(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    """Cross-entropy of the model's logits on ``inputs["x"]`` against ``inputs["y"]``."""
    return F.cross_entropy(model(inputs["x"]), inputs["y"])
