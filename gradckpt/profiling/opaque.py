"""Outputs whose tensors torch's pytree cannot see, refused with the fix.

The profiler, the plan's chain and the engine's segments find a unit's tensors
with ``torch.utils._pytree``: tuples, lists, dicts, named tuples and registered
types (transformers' ``ModelOutput``, diffusers' ``BaseOutput``) are walked; any
other object is one opaque leaf. A block that returns an unregistered dataclass
holding its hidden state hides that tensor: the profile loses where the block's
output lives and what the next block receives, and plans ran 2.5-12% over their
budget. Registering the type as a pytree node makes every part see it, so that
is what the error asks for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from gradckpt.profiling.records import ProfileError

__all__ = ["check_output_seen", "hides_tensors"]

_SCALARS = (str, bytes, int, float, complex, bool, type(None))


def hides_tensors(obj: Any, depth: int = 3) -> bool:
    """Whether ``obj`` (a pytree leaf) holds a tensor within ``depth`` levels.

    Looks into dataclasses, mappings, sequences and plain objects' attributes;
    not into callables (modules, functions), whose tensors are not outputs.

    Example:
        >>> @dataclasses.dataclass
        ... class Out:
        ...     hidden: torch.Tensor
        >>> hides_tensors(Out(torch.ones(1)))
        True
    """
    if isinstance(obj, torch.Tensor):
        return True
    if depth == 0 or isinstance(obj, _SCALARS) or callable(obj):
        return False
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values: Any = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    elif isinstance(obj, Mapping):
        values = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        values = obj
    elif hasattr(obj, "__dict__"):
        values = vars(obj).values()
    else:
        return False
    return any(hides_tensors(v, depth - 1) for v in values)


def check_output_seen(out: Any, path: str, module_cls: str) -> list[Any]:
    """``out``'s pytree leaves; raises :class:`ProfileError` when a leaf hides tensors.

    Example:
        >>> check_output_seen((torch.ones(1), 2), "blocks.0", "Block")[1]
        2
    """
    flat, _ = tree_flatten(out)
    for leaf in flat:
        if isinstance(leaf, (torch.Tensor, *_SCALARS)):
            continue
        if hides_tensors(leaf):
            cls = type(leaf)
            name = cls.__qualname__
            how = (
                f"torch.export.register_dataclass({name})"
                if dataclasses.is_dataclass(cls)
                else f"torch.utils._pytree.register_pytree_node({name}, flatten_fn, unflatten_fn)"
            )
            raise ProfileError(
                f"{path} ({module_cls}) returned a {cls.__module__}.{name} holding tensors that "
                "gradckpt cannot see: torch's pytree treats that type as one opaque leaf, so the "
                "profile would miss the block's output and the plan's memory would be wrong. "
                f"Register the type as a pytree node before planning ({how}), or return a "
                "tuple, dict or tensor."
            )
    return flat
