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

from torch import nn

from gradckpt.profiling.units import Unit

__all__ = ["SubCallRecord", "inner_candidates"]


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
