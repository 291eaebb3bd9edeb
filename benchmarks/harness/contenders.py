"""Contenders: ways to install checkpointing on a zoo example's model, each with its undo."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.utils.checkpoint as torch_ckpt
from torch import nn

import gradckpt
from gradckpt.testing import Example

Undo = Callable[[], None]
Installer = Callable[[Example], Undo]  # install a contender on an example's model; returns undo


def wrap_blocks(
    model: nn.Module, paths: Iterable[str], wrap: Callable[[Callable], Callable]
) -> Undo:
    """Replace each block's ``forward`` (instance attribute) by ``wrap(forward)``; returns undo."""
    modules = dict(model.named_modules())
    done: list[tuple[nn.Module, bool, Any]] = []
    for path in paths:
        module = modules[path]
        had_own = "forward" in module.__dict__
        done.append((module, had_own, module.__dict__.get("forward")))
        module.forward = wrap(module.forward)

    def undo() -> None:
        for module, had_own, previous in reversed(done):
            if had_own:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)

    return undo


def torch_checkpoint(forward: Callable) -> Callable:
    """``torch.utils.checkpoint.checkpoint(forward, ..., use_reentrant=False)``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return torch_ckpt.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def torch_sac(ops: Iterable[Any]) -> Callable[[Callable], Callable]:
    """torch selective activation checkpointing that saves the outputs of ``ops``."""
    context_fn = functools.partial(torch_ckpt.create_selective_checkpoint_contexts, list(ops))

    def wrap(forward: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            return torch_ckpt.checkpoint(
                forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs
            )

        return run

    return wrap


def gradckpt_checkpoint(policy: Any = None) -> Callable[[Callable], Callable]:
    """``gradckpt.checkpoint(forward, ..., policy=policy)``."""

    def wrap(forward: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            return gradckpt.checkpoint(forward, *args, policy=policy, **kwargs)

        return run

    return wrap


def library_checkpointing(model: nn.Module) -> None:
    """The model library's own per-layer checkpointing switch, non-reentrant: diffusers'
    ``enable_gradient_checkpointing``, transformers' ``activation_checkpointing_enable``
    (``gradient_checkpointing_enable`` before 5.x)."""
    if hasattr(model, "enable_gradient_checkpointing"):  # diffusers (non-reentrant)
        model.enable_gradient_checkpointing()
        return
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def plain() -> Installer:
    """The uncheckpointed model."""
    return lambda example: lambda: None


def per_block(
    wrap: Callable[[Callable], Callable], paths: Sequence[str] | None = None
) -> Installer:
    """Wrap every block (``paths``, default the zoo's ``block_paths``) with ``wrap``."""
    return lambda example: wrap_blocks(
        example.model, paths if paths is not None else example.block_paths, wrap
    )


def with_plan(plan: gradckpt.Plan) -> Installer:
    """``gradckpt.apply(model, plan)``; undone by ``gradckpt.remove``."""

    def install(example: Example) -> Undo:
        gradckpt.apply(example.model, plan)
        return lambda: gradckpt.remove(example.model)

    return install
