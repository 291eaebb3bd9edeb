"""Transformers' own per-layer checkpointing switch, with gradckpt's checkpoint.

:func:`enable` turns on transformers' per-layer checkpointing with
``gradckpt.checkpoint`` (and an optional per-op policy) instead of
``torch.utils.checkpoint``; :func:`disable` undoes it. The package
(:mod:`gradckpt.integrations.hf`) says how this sits beside ``gradckpt.fit``.

Example:
    >>> from gradckpt.integrations import hf
    >>> hf.enable(model, policy=gradckpt.policies.save_matmuls)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from gradckpt.integrations.hf.cache import (
    CACHE_WHY,
    cache_off,
    caches_turned_off_by_enable,
    generates,
    restore_cache,
)
from gradckpt.integrations.hf.notices import tell_once
from gradckpt.integrations.hf.recognize import is_hf_model, model_name

__all__ = ["checkpoint_function", "disable", "enable"]

# Options of gradckpt.checkpoint that may ride along with the function transformers
# calls; any other keyword would be passed on to the layer's forward.
_CHECKPOINT_OPTIONS = frozenset(
    {"preserve_rng_state", "determinism_check", "early_stop", "debug", "context_fn"}
)


def checkpoint_function(policy: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``gradckpt.checkpoint`` with ``policy`` and ``options`` bound, as transformers calls it.

    Transformers' layers call ``self._gradient_checkpointing_func(partial(forward,
    **kwargs), *args)``; this is that function.

    Args:
        policy: per-op policy (``gradckpt.policies.save_matmuls``, ...); None
            recomputes the whole layer.
        **options: other :func:`gradckpt.checkpoint` options (``preserve_rng_state``,
            ``determinism_check``, ``early_stop``, ``debug``, ``context_fn``).

    Example:
        >>> func = checkpoint_function(gradckpt.policies.save_matmuls)
        >>> model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    """
    from gradckpt.engine.checkpoint import checkpoint

    if options.pop("use_reentrant", False):
        raise ValueError(
            "gradckpt has only the non-reentrant mechanism (correct with kwargs, frozen "
            "inputs and autograd.grad); drop use_reentrant=True"
        )
    unknown = sorted(set(options) - _CHECKPOINT_OPTIONS)
    if unknown:
        # transformers would pass them on to every layer's forward, where they are
        # silently swallowed by **kwargs.
        raise TypeError(
            f"unknown gradckpt.checkpoint options {unknown}; known: {sorted(_CHECKPOINT_OPTIONS)}"
        )
    if policy is not None and not callable(policy):
        raise TypeError(f"policy must be callable, got {type(policy).__name__}")
    func = functools.partial(checkpoint, policy=policy, **options)
    func.__gradckpt__ = True  # type: ignore[attr-defined]
    return func


def enable(
    model: nn.Module,
    policy: Callable[..., Any] | None = None,
    *,
    every_n_layers: int = 1,
    **options: Any,
) -> nn.Module:
    """Turn on transformers' per-layer activation checkpointing, run by ``gradckpt.checkpoint``.

    The same placement as ``model.gradient_checkpointing_enable()`` (every layer,
    or every ``every_n_layers``-th), with gradckpt's mechanism: non-reentrant (so
    a frozen base with trainable adapters keeps its gradients without
    ``enable_input_require_grads``), module side effects applied once, and an
    optional per-op ``policy``. ``use_cache`` is turned off, with one message.
    Layers checkpoint only in training mode, as in transformers.

    Why not ``gradient_checkpointing_kwargs``: transformers builds
    ``functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)`` from them,
    so they can only configure torch's function; no keyword swaps it (unknown
    ones are even passed on to the layers' forward). This installs
    :func:`checkpoint_function` the way transformers does, through
    ``model._set_gradient_checkpointing(gradient_checkpointing_func=...)``
    (transformers >= 4.35).

    Args:
        model: a transformers ``PreTrainedModel`` that supports checkpointing.
        policy: per-op policy for every layer; None recomputes whole layers.
        every_n_layers: checkpoint only every n-th layer (needs a transformers
            that has this option).
        **options: other :func:`gradckpt.checkpoint` options.

    Returns:
        The model.

    Example:
        >>> from gradckpt.integrations import hf
        >>> model.train()
        >>> hf.enable(model, policy=gradckpt.policies.save_matmuls)
        >>> model(input_ids=ids, labels=ids).loss.backward()
        >>> hf.disable(model)
    """
    from gradckpt.apply.apply import applied_plan

    func = checkpoint_function(policy, **options)
    setter = _setter(model)
    if applied_plan(model) is not None:
        raise ValueError(
            "a gradckpt plan is applied to this model; checkpointing its layers again "
            "would recompute them twice. Call gradckpt.remove(model) first."
        )
    kwargs: dict[str, Any] = {"enable": True, "gradient_checkpointing_func": func}
    if "every_n_layers" in inspect.signature(setter).parameters:
        kwargs["every_n_layers"] = every_n_layers
    elif every_n_layers != 1:
        raise ValueError("every_n_layers needs a transformers version that supports it (5.x)")
    setter(**kwargs)
    changed = cache_off(model)
    caches_turned_off_by_enable.setdefault(model, []).extend(changed)
    if changed and generates(model):
        tell_once(
            model,
            "enable",
            f"gradckpt: checkpointing the layers of {model_name(model)} with gradckpt.checkpoint; "
            f"set use_cache=False ({CACHE_WHY}; generate() still uses the cache).",
        )
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable`: layers run plainly and ``use_cache`` is back as it was.

    Example:
        >>> hf.disable(model)
    """
    _setter(model)(enable=False)
    restore_cache(caches_turned_off_by_enable.pop(model, []))
    return model


def _setter(model: nn.Module) -> Callable[..., None]:
    if not is_hf_model(model) or not hasattr(model, "_set_gradient_checkpointing"):
        raise TypeError(
            f"{model_name(model)} is not a transformers PreTrainedModel; for other models use "
            "gradckpt.fit, or gradckpt.checkpoint around the blocks"
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{model_name(model)} does not support activation checkpointing")
    setter = model._set_gradient_checkpointing
    if "gradient_checkpointing_func" not in inspect.signature(setter).parameters:
        raise ValueError(
            f"{model_name(model)} overrides _set_gradient_checkpointing in the pre-4.35 format, "
            "which cannot take another checkpoint function"
        )
    return setter
