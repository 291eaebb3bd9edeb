"""Hugging Face transformers: plan a transformers model, or use its own switch with gradckpt.

Two ways in, both on models from ``transformers`` (optional extra ``hf``):

1. **Planned**: ``gradckpt.fit(model, loss_fn, budget)`` works on a transformers
   model as on any other. Its decoder/encoder layers (``GradientCheckpointingLayer``)
   are the blocks; embeddings, rotary tables, final norm and head are planned
   units too. While profiling, the KV cache is off (``use_cache=False``) and
   transformers' own checkpointing, if on, is paused; ``fit`` leaves both off
   for training and says so once (:func:`training`). The cache is kept off by
   passing ``use_cache=False`` to training forwards, not by editing the config
   (so ``save_pretrained`` writes the user's value); ``gradckpt.remove`` ends it.
2. **The usual switch**: :func:`enable` turns on transformers' per-layer
   checkpointing with ``gradckpt.checkpoint`` (and an optional per-op policy)
   instead of ``torch.utils.checkpoint``; :func:`disable` undoes it.

Why ``use_cache`` must be off for training: a layer recomputed in backward calls
``cache.update`` a second time, so the KV cache grows by a second copy of every
recomputed layer's keys and values (memory the plan did not count). Generation
is unaffected: ``generate()`` passes ``generation_config.use_cache`` explicitly.

This module does not import ``transformers``: it recognizes its classes by the
module they come from, so ``import gradckpt`` stays light.

Example:
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> from gradckpt.integrations import hf
    >>> model = GPT2LMHeadModel(GPT2Config(n_layer=4)).train()
    >>> plan = gradckpt.fit(model, lambda: model(input_ids=ids, labels=ids).loss, budget=0.6)
    >>> # or, keeping transformers' one-checkpoint-per-layer placement:
    >>> hf.enable(other_model, policy=gradckpt.policies.save_matmuls)

See ``examples/hf_finetune.py`` for both, with a frozen base and LoRA adapters.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "checkpoint_function",
    "disable",
    "disable_cache",
    "enable",
    "is_hf_model",
    "planning",
    "training",
]

# Options of gradckpt.checkpoint that may ride along with the function transformers
# calls; any other keyword would be passed on to the layer's forward.
_CHECKPOINT_OPTIONS = frozenset(
    {"preserve_rng_state", "determinism_check", "early_stop", "debug", "context_fn"}
)

_told: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
_caches_turned_off: weakref.WeakKeyDictionary[nn.Module, list[tuple[Any, bool]]] = (
    weakref.WeakKeyDictionary()
)


# --------------------------------------------------------------------------- recognizing


def _from_transformers(cls: type) -> bool:
    return any(c.__module__.partition(".")[0] == "transformers" for c in cls.__mro__)


def is_hf_model(model: nn.Module) -> bool:
    """True if ``model`` is, or holds, a module whose class comes from transformers.

    Never imports transformers: a model cannot hold transformers classes unless
    transformers was imported already.

    Example:
        >>> is_hf_model(GPT2LMHeadModel(GPT2Config()))
        True
    """
    if "transformers" not in sys.modules:
        return False
    return any(_from_transformers(type(m)) for m in model.modules())


def _tell_once(model: nn.Module, key: str, message: str) -> None:
    # One message per model and subject: fitting, re-planning or enabling the same
    # model again says nothing new.
    said = _told.setdefault(model, set())
    if key not in said:
        said.add(key)
        warnings.warn(message, UserWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The warning stack level of the first frame outside gradckpt (the user's call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # gradckpt/
    frame, level = sys._getframe(1), 1  # level 1: _tell_once, which calls warnings.warn
    while frame is not None and (
        frame.f_code.co_filename.startswith(package)
        or frame.f_code.co_filename == contextlib.__file__
    ):
        frame, level = frame.f_back, level + 1
    return level


def _name(model: nn.Module) -> str:
    return type(model).__name__


# --------------------------------------------------------------------------- use_cache


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
            and _from_transformers(type(config))
            and getattr(config, "use_cache", False) is True
        ):
            found[id(config)] = config
    return list(found.values())


def _cache_off(model: nn.Module) -> list[tuple[Any, bool]]:
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
    return len(_cache_off(model))


def _generates(model: nn.Module) -> bool:
    """Whether the KV cache means anything for this model (BERT's config has one too)."""
    can_generate = getattr(model, "can_generate", None)
    try:
        return bool(can_generate()) if callable(can_generate) else True
    except Exception:  # a custom model whose can_generate needs more than itself
        return True


def _restore_cache(changed: list[tuple[Any, bool]]) -> None:
    for config, value in changed:
        config.use_cache = value


_CACHE_WHY = (
    "a KV cache is for generation, and under checkpointing each recomputed layer would "
    "append its keys and values to it a second time"
)


# --------------------------------------------------------------------------- HF's own switch


def _switched_on(model: nn.Module) -> list[nn.Module]:
    """Modules on which transformers' own checkpointing is on."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


def _switch_off(modules: list[nn.Module]) -> None:
    for module in modules:
        module.gradient_checkpointing = False


def _switch_on(modules: list[nn.Module]) -> None:
    for module in modules:
        module.gradient_checkpointing = True


@contextlib.contextmanager
def planning(model: nn.Module) -> Iterator[None]:
    """Profile ``model`` as it trains plainly: no KV cache, transformers' checkpointing paused.

    Used by ``gradckpt.plan``/``frontier`` around profiling; everything is put back
    on exit, and each change is announced once per model, with what to do when
    the plan is applied by hand (``gradckpt.fit`` does it itself).

    Example:
        >>> with planning(model):
        ...     prof = gradckpt.profile(model, loss_fn)
    """
    caches = _cache_off(model)
    paused = _switched_on(model)
    _switch_off(paused)
    try:
        if caches and _generates(model):
            _tell_once(
                model,
                "plan-cache",
                f"gradckpt: planned {_name(model)} with use_cache=False ({_CACHE_WHY}); train "
                "it so too: gradckpt.integrations.hf.disable_cache(model) (gradckpt.fit does "
                "this for you).",
            )
        if paused:
            _tell_once(
                model,
                "plan-switch",
                f"gradckpt: planned {_name(model)} without transformers' own activation "
                "checkpointing, which is on; applying the plan on top of it would checkpoint "
                "every layer twice. Call model.activation_checkpointing_disable() (or "
                "gradient_checkpointing_disable()) before gradckpt.apply, or use gradckpt.fit.",
            )
        yield
    finally:
        _switch_on(paused)
        _restore_cache(caches)


@contextlib.contextmanager
def fake_friendly() -> Iterator[None]:
    """Let transformers take its real-data branch where fake tensors would hide the data.

    ``masking_utils.find_packed_sequence_indices`` decides "no packed sequences"
    by reading the position ids; under fake tensors it cannot, so transformers
    assumes packing and builds a full mask, which also moves attention off the
    fused kernel: the fake profile then keeps more than the real step (+8% on a
    small Llama). While profiling under fake tensors we answer "not packed",
    which is what ordinary batches (position ids 0..T-1) give. Models fed
    packed sequences should be planned on real tensors.
    """
    import transformers.masking_utils as masking
    from torch._subclasses.fake_tensor import FakeTensor

    original = masking.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if isinstance(position_ids, FakeTensor):
            return None
        return original(position_ids)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


@contextlib.contextmanager
def training(model: nn.Module) -> Iterator[None]:
    """Set ``model`` up for training under a gradckpt plan; used by ``gradckpt.fit``.

    Turns ``use_cache`` off and transformers' own checkpointing off (the plan now
    decides what every layer keeps) and keeps them off if the body succeeds, with
    one message; if the body raises (e.g. no plan fits), everything is put back.

    Example:
        >>> with training(model):
        ...     gradckpt.apply(model, gradckpt.plan(model, loss_fn, budget))
    """
    caches = _cache_off(model)
    switched = _switched_on(model)
    _switch_off(switched)
    try:
        yield
    except BaseException:
        _switch_on(switched)
        _restore_cache(caches)
        raise
    # The plan owns these settings now: a later hf.disable must not turn the cache back on.
    _caches_turned_off.pop(model, None)
    if caches:
        _keep_cache_off_for_training(model, caches)
    done = []
    if caches and _generates(model):
        done.append(f"set use_cache=False ({_CACHE_WHY}; generate() still uses the cache)")
    if switched:
        done.append(
            "turned transformers' own activation checkpointing off (the plan now decides "
            "what each layer keeps)"
        )
    if done:
        _tell_once(model, "fit", f"gradckpt.fit on {_name(model)}: " + "; ".join(done) + ".")


def _no_cache_while_training(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Forward pre-hook: a forward under grad that does not choose ``use_cache`` gets False."""
    if torch.is_grad_enabled() and kwargs.get("use_cache") is None:
        return args, {**kwargs, "use_cache": False}
    return None


class _RestoreCache:
    """Puts ``use_cache`` back on the configs :func:`training` turned it off on (at ``remove``)."""

    def __init__(self, changed: list[tuple[Any, bool]]) -> None:
        self.changed = changed

    def __call__(self) -> None:
        _restore_cache(self.changed)


def _keep_cache_off_for_training(model: nn.Module, caches: list[tuple[Any, bool]]) -> None:
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
    _restore_cache(caches)
    hooks = model._forward_pre_hooks.values()
    if not any(hook is _no_cache_while_training for hook in hooks):
        handle = model.register_forward_pre_hook(_no_cache_while_training, with_kwargs=True)
        on_remove(model, handle.remove)


# --------------------------------------------------------------------------- the switch


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
    changed = _cache_off(model)
    _caches_turned_off.setdefault(model, []).extend(changed)
    if changed and _generates(model):
        _tell_once(
            model,
            "enable",
            f"gradckpt: checkpointing the layers of {_name(model)} with gradckpt.checkpoint; "
            f"set use_cache=False ({_CACHE_WHY}; generate() still uses the cache).",
        )
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable`: layers run plainly and ``use_cache`` is back as it was.

    Example:
        >>> hf.disable(model)
    """
    _setter(model)(enable=False)
    _restore_cache(_caches_turned_off.pop(model, []))
    return model


def _setter(model: nn.Module) -> Callable[..., None]:
    if not is_hf_model(model) or not hasattr(model, "_set_gradient_checkpointing"):
        raise TypeError(
            f"{_name(model)} is not a transformers PreTrainedModel; for other models use "
            "gradckpt.fit, or gradckpt.checkpoint around the blocks"
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{_name(model)} does not support activation checkpointing")
    setter = model._set_gradient_checkpointing
    if "gradient_checkpointing_func" not in inspect.signature(setter).parameters:
        raise ValueError(
            f"{_name(model)} overrides _set_gradient_checkpointing in the pre-4.35 format, "
            "which cannot take another checkpoint function"
        )
    return setter


def __getattr__(name: str) -> Any:  # BudgetCallback imports transformers: load it on first use
    if name == "BudgetCallback":
        from gradckpt.integrations.hf_trainer import BudgetCallback

        return BudgetCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
