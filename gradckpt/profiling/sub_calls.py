"""Modules inside blocks whose calls a profile records: where token-wise chunking may go.

A plan may run a block's MLP (any feed-forward sub-module whose output for a
token depends on that token alone) in slices of tokens
(:mod:`gradckpt.planning.kinds.chunk.token_wise`). The planner tells such a
module from its ops, so the profile notes the op span of every call of each
*inner candidate*: a direct child of a block unit that has children of its own
(an attention, an MLP; not a lone ``nn.Linear`` or norm) and is not a unit
itself. Which of them are token-wise is decided on the profile, never by name.

Example:
    >>> [path for path, _ in inner_candidates(units)]
    ['layers.0.self_attn', 'layers.0.mlp', ...]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from gradckpt.profiling.units import Unit

__all__ = ["SubCall", "SubCallRecord", "enter_sub", "exit_sub", "inner_candidates"]


@dataclass
class SubCall:
    """One call of an inner module while a pass records (its unit is a call serial)."""

    path: str
    unit: int  # serial of the enclosing unit call
    first_op: int
    end_op: int = -1
    input: int = -1  # storage id of its first tensor argument
    output: int = -1  # storage id of its first tensor result
    input_shape: tuple[int, ...] = ()
    output_shape: tuple[int, ...] = ()
    tensor_args: int = 0  # tensors among its arguments (keyword ones included)


def enter_sub(recorder: Any, path: str, args: tuple, kwargs: dict) -> SubCall | None:
    """Note a call of an inner module on ``recorder`` (a StepRecorder); None outside units.

    Example:
        >>> call = enter_sub(recorder, "layers.0.mlp", (x,), {})
    """
    if not recorder._stack or not recorder.forward:
        return None
    call = SubCall(path, recorder._stack[-1].serial, len(recorder.ops))
    flat, _ = tree_flatten((args, kwargs))
    call.tensor_args = sum(isinstance(a, torch.Tensor) for a in flat)
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None:
        call.input, call.input_shape = recorder.sid_of(first), tuple(first.shape)
    return call


def exit_sub(recorder: Any, call: SubCall | None, out: Any) -> None:
    """Close ``call`` (from :func:`enter_sub`) with the call's result ``out``."""
    if call is None:
        return
    call.end_op = len(recorder.ops)
    flat, _ = tree_flatten(out)
    first = next((x for x in flat if isinstance(x, torch.Tensor)), None)
    if first is not None:
        call.output, call.output_shape = recorder.sid_of(first), tuple(first.shape)
    recorder.sub_calls.append(call)


@dataclass(frozen=True, slots=True)
class SubCallRecord:
    """One call of an inner candidate, as the profile holds it.

    ``unit`` is the index of the unit whose forward made the call; ops
    ``[first_op, end_op)`` are its forward; ``input``/``output`` the storage ids
    of its first tensor argument and result (-1: made outside the step).
    """

    path: str
    unit: int
    first_op: int
    end_op: int
    input: int
    output: int
    input_shape: tuple[int, ...] = ()
    output_shape: tuple[int, ...] = ()
    tensor_args: int = 0  # tensors among its arguments (keyword ones included)


def inner_candidates(units: list[Unit]) -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` of each direct child of a block unit that has children and is no unit.

    Example:
        >>> dict(inner_candidates(units)).keys()
    """
    taken = {id(u.module) for u in units}
    seen: set[int] = set()
    for unit in units:
        if not unit.is_block:
            continue
        for name, child in unit.module.named_children():
            if id(child) in taken or id(child) in seen or not any(True for _ in child.children()):
                continue
            seen.add(id(child))
            yield (f"{unit.path}.{name}" if unit.path else name), child
