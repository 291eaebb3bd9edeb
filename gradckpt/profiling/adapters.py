"""Adapters: what gradckpt needs to know about one model family, registered from above.

A model family (transformers, diffusers, PEFT, a user's own library) may need
the model prepared before its step is profiled (transformers: no KV cache),
friendlier code paths under fake tensors, its blocks named, or switches set
for training. Its integration (layer 7) registers an :class:`Adapter` here;
the profiler (:func:`gradckpt.profiling.profile`), block discovery
(:mod:`gradckpt.profiling.units`) and the API consult the registry, so no lower
layer ever imports an integration. ``import gradckpt`` registers the built-in
adapters (``gradckpt.integrations``) without importing their libraries: each
recognizes its models by their classes' module names.

Example:
    >>> register_adapter(Adapter(
    ...     "mylib",
    ...     recognizes=lambda model: type(model).__module__.startswith("mylib."),
    ...     find_blocks=lambda model: [n for n, m in model.named_modules()
    ...                                if type(m).__name__ == "MyBlock"],
    ... ))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from torch import nn

__all__ = [
    "Adapter",
    "adapters_for",
    "preparing",
    "register_adapter",
    "registered_blocks",
    "training",
]

Context = Callable[[nn.Module], AbstractContextManager[None]]


def _every_model(model: nn.Module) -> bool:
    return True


@dataclass(frozen=True)
class Adapter:
    """One model family's hooks; every hook is optional.

    Attributes:
        name: registry key (registering the same name again replaces the adapter).
        recognizes: ``model -> bool``: whether the hooks below apply to ``model``.
        find_blocks: ``model -> [paths]`` of its repeated blocks ([] to defer to
            the generic rules); the first registered adapter that names blocks wins.
        prepare: ``model -> context`` that profiling runs in (transformers: no KV
            cache); left when profiling ends.
        fake_inputs: ``model -> context`` entered as well when profiling under
            fake tensors (code paths that read tensor data at real sizes).
        training: ``model -> context`` that ``gradckpt.fit`` plans and applies in;
            the settings it makes for training stay.
    """

    name: str
    recognizes: Callable[[nn.Module], bool] = _every_model
    find_blocks: Callable[[nn.Module], list[str]] | None = None
    prepare: Context | None = None
    fake_inputs: Context | None = None
    training: Context | None = None


_ADAPTERS: dict[str, Adapter] = {}


def register_adapter(adapter: Adapter) -> Adapter:
    """Add ``adapter`` to the registry (replacing one of the same name); returns it.

    Example:
        >>> register_adapter(Adapter("mylib", recognizes=is_mylib_model, prepare=no_cache))
    """
    if not isinstance(adapter, Adapter):
        raise TypeError(f"register_adapter takes an Adapter, got {type(adapter).__name__}")
    _ADAPTERS[adapter.name] = adapter
    return adapter


def adapters_for(model: nn.Module) -> list[Adapter]:
    """The registered adapters that recognize ``model``, in registration order.

    Example:
        >>> [a.name for a in adapters_for(hf_model)]
        ['shape guard', 'transformers']
    """
    return [a for a in _ADAPTERS.values() if a.recognizes(model)]


def registered_blocks(model: nn.Module) -> list[str]:
    """The block paths the first adapter that knows ``model``'s blocks names, or [].

    Example:
        >>> registered_blocks(unet)[:1]
        ['down_blocks.0.resnets.0']
    """
    for adapter in adapters_for(model):
        if adapter.find_blocks is not None:
            found = adapter.find_blocks(model)
            if found:
                return list(found)
    return []


def _entered(model: nn.Module, hooks: list[Context]) -> AbstractContextManager[None]:
    stack = contextlib.ExitStack()
    try:
        for hook in hooks:
            stack.enter_context(hook(model))
    except BaseException:
        stack.close()  # nothing left half-prepared
        raise
    return stack


def preparing(model: nn.Module, *, fake: bool = False) -> AbstractContextManager[None]:
    """Every registered preparation for profiling ``model`` (``fake``: and its fake-input
    paths), entered now; leaving the returned context undoes them.

    Example:
        >>> with preparing(model, fake=True):
        ...     step()
    """
    hooks: list[Context] = []
    for adapter in adapters_for(model):
        if adapter.prepare is not None:
            hooks.append(adapter.prepare)
        if fake and adapter.fake_inputs is not None:
            hooks.append(adapter.fake_inputs)
    return _entered(model, hooks)


def training(model: nn.Module) -> AbstractContextManager[None]:
    """Every registered training switch for ``model``, entered now.

    Example:
        >>> with training(model):
        ...     gradckpt.apply(model, plan)
    """
    return _entered(model, [a.training for a in adapters_for(model) if a.training is not None])
