"""The engine's costs on one of the model's own blocks, timed at profile time.

The per-op costs measured on chains of tiny ops
(:mod:`gradckpt.measure.engine_costs`) miss what a real block pays: on the
demo's GPT a plan of selective units ran 13 points slower than predicted
(issue #31). So a profile captures the arguments of one call of the first
block while it times the plain step, and afterwards times that block's forward
on them as a region and as a selective region
(:func:`~gradckpt.measure.engine_costs.time_unit_regions`), and a short block
as whole steps too, plain and as a region. The seconds go into the profile's
:class:`~gradckpt.measure.engine_costs.EngineCosts`; the planner turns them into
the policy's per-op cost and into how much more (or less) than the chains the
engine costs on this model's blocks
(:func:`gradckpt.planning.simulation.costs.step_costs`).

Like op times, a unit's times are kept for the process
(:func:`gradckpt.profiling.calibration.settled_unit_times`): profiling the same
model again plans the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from gradckpt.measure.engine_costs import time_unit_regions
from gradckpt.profiling.calibration import settled_unit_times
from gradckpt.profiling.records import Profile
from gradckpt.profiling.units import Unit

__all__ = ["CapturedCall", "capturing_call", "with_unit_times"]


@dataclass
class CapturedCall:
    """The first call of one block during the timed steps: its module and arguments (copies)."""

    path: str = ""
    module: nn.Module | None = None
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def _copy(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().clone()
    return copy.requires_grad_() if value.requires_grad else copy


@contextlib.contextmanager
def capturing_call(units: list[Unit]) -> Iterator[CapturedCall]:
    """Keep copies of the arguments of the first call of the first block inside the block.

    Example:
        >>> with capturing_call(units) as call:
        ...     loss_fn().backward()
    """
    captured = CapturedCall()
    block = next((u for u in units if u.is_block), None)
    if block is None:
        yield captured
        return

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if captured.module is not None or captured.path:
            return
        captured.path = block.path  # tried once: a failed copy is not retried
        try:
            captured.args, captured.kwargs = tree_map(_copy, (args, kwargs))
        except Exception:  # arguments that cannot be copied (a tensor subclass): not timed
            return
        captured.module = module

    handle = block.module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield captured
    finally:
        handle.remove()


def with_unit_times(profile: Profile, call: CapturedCall) -> Profile:
    """``profile`` with the captured block timed into its engine costs (unchanged when
    there is no such block, it is not a plannable unit, or timing it fails).

    Example:
        >>> prof = with_unit_times(prof, call)
        >>> prof.engine_costs.unit_policy  # what a policy adds to the block's region forward
    """
    module = call.module
    record = next((u for u in profile.units if u.module_path == call.path), None)
    if module is None or record is None or not (record.is_block and record.plannable):
        return profile
    tensors = [*module.parameters(), *_flat(call.args, call.kwargs)]
    if not any(t.requires_grad for t in tensors):
        return profile  # nothing to differentiate: no region would record it
    shapes = tuple(tuple(t.shape) for t in _flat(call.args, call.kwargs))
    key = (profile.device, profile.fingerprint, call.path, shapes)

    def measure() -> Any:
        buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
        try:
            with torch.enable_grad():
                return time_unit_regions(module, call.args, call.kwargs, profile.device)
        except Exception:  # a unit that cannot run alone: the tiny chains' costs stand
            return None
        finally:
            with torch.no_grad():
                for name, b in module.named_buffers():
                    b.copy_(buffers[name])  # a plain forward updated running statistics

    times = settled_unit_times(key, measure)
    if times is None:
        return profile
    costs = replace(
        profile.engine_costs, unit=call.path, unit_region=times.region, unit_policy=times.policy,
        unit_step=times.step, unit_region_step=times.region_step, unit_forward=times.forward,
    )  # fmt: skip
    return replace(profile, engine_costs=costs)


def _flat(args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
