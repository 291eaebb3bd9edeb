"""The KV cache (``use_cache``) of transformers models: off for planning and training.

Why it must be off for training: a layer recomputed in backward calls
``cache.update`` a second time, so the KV cache grows by a second copy of every
recomputed layer's keys and values (memory the plan did not count). Generation
is unaffected: ``generate()`` passes ``generation_config.use_cache`` explicitly.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from gradckpt.integrations.hf.recognize import from_transformers

# The configs hf.enable turned the cache off on, per model, so hf.disable can put them back.
caches_turned_off_by_enable: weakref.WeakKeyDictionary[nn.Module, list[tuple[Any, bool]]] = (
    weakref.WeakKeyDictionary()
)

CACHE_WHY = (
    "a KV cache is for generation, and under checkpointing each recomputed layer would "
    "append its keys and values to it a second time"
)


def _configs_with_cache(model: nn.Module) -> list[Any]:
    """Distinct transformers configs on the model's modules whose ``use_cache`` is on.

    Sub-models may carry their own config objects (T5's encoder and decoder
    stacks hold copies; a multimodal model's language model holds ``text_config``).
    """
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if (
            config is not None
            and id(config) not in found
            and from_transformers(type(config))
            and getattr(config, "use_cache", False) is True
        ):
            found[id(config)] = config
    return list(found.values())


def cache_off(model: nn.Module) -> list[tuple[Any, bool]]:
    """Set ``use_cache=False`` on every config that has it on; returns what to restore."""
    changed = []
    for config in _configs_with_cache(model):
        changed.append((config, config.use_cache))
        config.use_cache = False
    return changed


def disable_cache(model: nn.Module) -> int:
    """Set ``use_cache=False`` on every transformers config the model holds; returns how many.

    ``model.config.use_cache = False`` is not always enough: T5's encoder and
    decoder stacks hold their own copies of the config, and the decoder reads
    its copy (so it would still build a KV cache). ``gradckpt.fit`` calls this.

    Example:
        >>> gradckpt.apply(model, plan)
        >>> hf.disable_cache(model)
    """
    return len(cache_off(model))


def generates(model: nn.Module) -> bool:
    """Whether the KV cache means anything for this model (BERT's config has one too)."""
    can_generate = getattr(model, "can_generate", None)
    try:
        return bool(can_generate()) if callable(can_generate) else True
    except Exception:  # a custom model whose can_generate needs more than itself
        return True


def restore_cache(changed: list[tuple[Any, bool]]) -> None:
    """Put back the ``use_cache`` values :func:`cache_off` returned."""
    for config, value in changed:
        config.use_cache = value


def _no_cache_while_training(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Forward pre-hook: a forward under grad that does not choose ``use_cache`` gets False."""
    if torch.is_grad_enabled() and kwargs.get("use_cache") is None:
        return args, {**kwargs, "use_cache": False}
    return None


# The shape guard reads the call as the user wrote it, without what this hook adds.
_no_cache_while_training.gradckpt_sets = {"use_cache": False}  # type: ignore[attr-defined]


class _RestoreCache:
    """Puts ``use_cache`` back on the configs :func:`training` turned it off on (at ``remove``)."""

    def __init__(self, changed: list[tuple[Any, bool]]) -> None:
        self.changed = changed

    def __call__(self) -> None:
        restore_cache(self.changed)


def keep_cache_off_for_training(model: nn.Module, caches: list[tuple[Any, bool]]) -> None:
    """No KV cache in training steps while the plan is applied; ``remove`` undoes it.

    When the model's forward takes ``use_cache``, the configs are left as the user
    set them (``save_pretrained`` writes those) and training calls that do not
    pass it get ``use_cache=False`` from a pre-hook (``generate()`` passes it).
    Otherwise the configs stay off until ``gradckpt.remove`` restores them.
    """
    from gradckpt.apply.apply import on_remove

    if "use_cache" not in inspect.signature(type(model).forward).parameters:
        on_remove(model, _RestoreCache(caches))
        return
    restore_cache(caches)
    hooks = model._forward_pre_hooks.values()
    if not any(hook is _no_cache_while_training for hook in hooks):
        handle = model.register_forward_pre_hook(_no_cache_while_training, with_kwargs=True)
        on_remove(model, handle.remove)
