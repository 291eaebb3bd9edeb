"""What the transformers adapter does around profiling and ``fit``.

:func:`planning` profiles a model as it trains plainly (no KV cache,
transformers' own checkpointing paused, both put back); :func:`training` leaves
them off once a plan is applied; :func:`fake_friendly` lets transformers take
its real-data branch under fake tensors. ``gradckpt.integrations`` registers
them as the ``transformers`` :class:`~gradckpt.profiling.adapters.Adapter`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from gradckpt.integrations.hf.cache import (
    CACHE_WHY,
    cache_off,
    caches_turned_off_by_enable,
    generates,
    keep_cache_off_for_training,
    restore_cache,
)
from gradckpt.integrations.hf.notices import tell_once
from gradckpt.integrations.hf.recognize import model_name

# Transformers' own switch: modules with gradient_checkpointing=True. Planning
# pauses it; training under a plan turns it off for good.


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
    caches = cache_off(model)
    paused = _switched_on(model)
    _switch_off(paused)
    try:
        if caches and generates(model):
            tell_once(
                model,
                "plan-cache",
                f"gradckpt: planned {model_name(model)} with use_cache=False ({CACHE_WHY}); train "
                "it so too: gradckpt.integrations.hf.disable_cache(model) (gradckpt.fit does "
                "this for you).",
            )
        if paused:
            tell_once(
                model,
                "plan-switch",
                f"gradckpt: planned {model_name(model)} without transformers' own activation "
                "checkpointing, which is on; applying the plan on top of it would checkpoint "
                "every layer twice. Call model.activation_checkpointing_disable() (or "
                "gradient_checkpointing_disable()) before gradckpt.apply, or use gradckpt.fit.",
            )
        yield
    finally:
        _switch_on(paused)
        restore_cache(caches)


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
    caches = cache_off(model)
    switched = _switched_on(model)
    _switch_off(switched)
    try:
        yield
    except BaseException:
        _switch_on(switched)
        restore_cache(caches)
        raise
    # The plan owns these settings now: a later hf.disable must not turn the cache back on.
    caches_turned_off_by_enable.pop(model, None)
    if caches:
        keep_cache_off_for_training(model, caches)
    done = []
    if caches and generates(model):
        done.append(f"set use_cache=False ({CACHE_WHY}; generate() still uses the cache)")
    if switched:
        done.append(
            "turned transformers' own activation checkpointing off (the plan now decides "
            "what each layer keeps)"
        )
    if done:
        tell_once(model, "fit", f"gradckpt.fit on {model_name(model)}: " + "; ".join(done) + ".")
