"""A plan's cost on a pipeline stage: its peak with ``k`` micro-batches in flight, and time.

The formula and what each part is are in :mod:`gradckpt.integrations.pipeline`.

Example:
    >>> stage_cost(prof, plan, in_flight=4, parts=StageParts(buffer_bytes=1 << 20)).peak_bytes
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.simulation.simulate import live_trace, simulate
from gradckpt.profiling.records import Profile

__all__ = ["StageCost", "StageParts", "held_bytes", "output_bytes", "stage_cost", "tensor_bytes"]


@dataclass(frozen=True)
class StageCost:
    """A plan's cost on a stage with ``in_flight`` micro-batches (see the module docstring)."""

    peak_bytes: int
    held_bytes: int  # one micro-batch's activations, forward end to backward
    time_per_microbatch: float  # forward and backward of one micro-batch, seconds


def held_bytes(profile: Profile, plan: Plan) -> int:
    """What one micro-batch keeps from the end of its forward to its backward under ``plan``
    (the simulator's live bytes at the last forward op, parameters and resident state aside)."""
    end = profile.ops[profile.forward_ops - 1].position if profile.forward_ops else 0
    positions, lives, _ = live_trace(profile, plan)
    held = 0
    for pos, live in zip(positions, lives):
        if pos > end:
            break
        held = live
    return max(held, 0)


@dataclass(frozen=True)
class StageParts:
    """What a stage holds besides its module's step (see the module docstring)."""

    buffer_bytes: int = 0  # receive buffers, M per direction, kept from the first step
    output_bytes: int = 0  # the last stage's outputs it holds (in flight, or all M kept)
    merged_bytes: int = 0  # the outputs merged at the end of the step (0: not returned)


def stage_cost(profile: Profile, plan: Plan, in_flight: int, parts: StageParts) -> StageCost:
    """The stage's peak and time per micro-batch under ``plan`` with ``in_flight`` held.

    Example:
        >>> stage_cost(prof, plan, in_flight=4, parts=StageParts()).peak_bytes
    """
    pred = simulate(profile, plan)
    held = held_bytes(profile, plan)
    fwd_bwd = pred.fwd_bwd_peak_bytes or pred.peak_bytes
    extra = parts.buffer_bytes + parts.output_bytes
    step_end = profile.param_bytes + profile.resident_bytes + extra + parts.merged_bytes
    peak = max(
        fwd_bwd + (in_flight - 1) * held + extra,
        profile.floor_bytes + extra if profile.floor_bytes else 0,
        step_end if parts.merged_bytes else 0,
    )
    return StageCost(peak, held, pred.step_time)


def tensor_bytes(inputs: Sequence[Any]) -> int:
    """Bytes of the tensors in ``inputs`` (other values count nothing).

    Example:
        >>> tensor_bytes((torch.zeros(4), 3))
        16
    """
    return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))


def output_bytes(module: nn.Module, inputs: Sequence[Any]) -> int:
    """Bytes of the stage's output for one micro-batch, from a forward on fake tensors.

    Example:
        >>> output_bytes(nn.Linear(4, 8), (torch.zeros(2, 4),))
        64
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if any(p.device.type == "meta" for p in module.parameters()):  # built without memory
        meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs]
        with torch.no_grad():
            out = module(*meta)
    else:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
            out = module(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tensor_bytes(outs)
