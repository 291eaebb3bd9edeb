"""Public entry points of the engine: ``checkpoint`` and ``checkpoint_sequential``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradckpt.engine import dynamo
from gradckpt.engine.frame import Frame
from gradckpt.engine.holders import in_region_forward
from gradckpt.engine.writes import module_state

__all__ = ["checkpoint", "checkpoint_sequential", "region_for", "run_checkpointed"]

_DETERMINISM_CHECKS = ("default", "none")


def _validate(fn: Any, policy: Any, determinism_check: Any, use_reentrant: Any) -> None:
    if not callable(fn):
        raise TypeError(f"gradckpt.checkpoint needs a callable to run, got {type(fn).__name__}")
    if policy is not None and not callable(policy):
        raise TypeError(
            f"policy must be a callable (ctx, op, *args, **kwargs) -> SAVE/RECOMPUTE, got "
            f"{type(policy).__name__}; see gradckpt.policies for ready-made ones"
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check must be one of {list(_DETERMINISM_CHECKS)}, "
            f"got {determinism_check!r}"
        )
    if use_reentrant:
        raise ValueError(
            "gradckpt has only the non-reentrant mechanism (it is correct with kwargs, "
            "frozen inputs and autograd.grad); drop use_reentrant=True"
        )


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    policy: Callable[..., Any] | None = None,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    early_stop: bool | None = None,
    debug: bool | None = None,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    A drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``
    that also: replays module side effects once (BatchNorm statistics are not
    updated twice), takes a per-op ``policy`` that works with several backward
    passes, and never warns about ``use_reentrant``.

    Args:
        fn: the function or module to run.
        *args: its positional arguments; tensors may sit inside lists, tuples and dicts.
        policy: ``policy(ctx, op, *args, **kwargs) -> SAVE | RECOMPUTE`` per ATen op;
            outputs of SAVE ops are kept and not recomputed. None recomputes all.
        preserve_rng_state: replay the CPU and device RNG so dropout masks match.
        determinism_check: "default" compares shape/dtype/device of recomputed
            tensors with the forward's; "none" skips the check.
        early_stop: stop the recompute once the last needed tensor is rebuilt
            (default True). None defers to torch's global
            ``torch.utils.checkpoint.set_checkpoint_early_stop(...)``; an explicit
            value wins over it (the preferred form: it says what this call does).
        debug: record op sequences and print them in recompute mismatch errors
            (default False). None defers to torch's
            ``set_checkpoint_debug_enabled(...)``; an explicit value wins over it.
        use_reentrant: accepted for compatibility; only False/None are allowed.
        context_fn: returns (forward context, recompute context), as in torch.
        **kwargs: keyword arguments for ``fn``.

    Under ``torch.compile`` the region is a graph break: it runs eagerly, in its
    forward and its recompute alike (compiled code inside it runs eagerly too),
    and the code around it compiles. ``gradckpt.compiled.around_regions`` compiles
    region bodies themselves.

    Returns:
        What ``fn`` returns.

    Example:
        >>> y = gradckpt.checkpoint(block, x, policy=gradckpt.policies.save_matmuls)
        >>> y.sum().backward()
    """
    _validate(fn, policy, determinism_check, use_reentrant)
    return run_checkpointed(
        fn,
        args,
        kwargs,
        policy=policy,
        preserve_rng_state=preserve_rng_state,
        check_metadata=determinism_check == "default",
        early_stop=early_stop,
        debug=debug,
        context_fn=context_fn,
    )


def run_checkpointed(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    name: str = "",
    **options: Any,
) -> Any:
    """:func:`checkpoint` with arguments passed explicitly (no clash with ``fn``'s kwargs).

    ``options`` are :class:`~gradckpt.engine.Frame` options (policy, early_stop, ...).
    Opaque to torch.compile: a compiled caller graph-breaks here.
    """
    if dynamo.is_compiling():
        return dynamo.opaque(run_checkpointed)(fn, args, kwargs, name=name, **options)
    if not torch.is_grad_enabled() or in_region_forward():
        # Nothing is saved under no_grad; inside another region's forward the
        # enclosing region recomputes this one anyway.
        return fn(*args, **kwargs)
    frame = region_for(fn, args, kwargs, name=name, **options)
    with frame.forward():
        return fn(*args, **kwargs)


def region_for(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str = "",
    **options: Any,
) -> Frame:  # fmt: skip
    """The region :func:`run_checkpointed` opens for ``fn(*args, **kwargs)``, inputs kept,
    its forward not run yet (a chunk deferring its slices makes them so, see
    :mod:`gradckpt.engine.chunking.slices`)."""
    if not kwargs and all(_is_leaf(a) for a in args):
        # The common call, block(x): pytree's walk costs more than the rest of the entry.
        flat = list(args)

        def body(inputs: list[Any]) -> Any:
            return fn(*inputs)

    else:
        flat, spec = tree_flatten((args, kwargs))

        def body(inputs: list[Any]) -> Any:
            call_args, call_kwargs = tree_unflatten(inputs, spec)
            return fn(*call_args, **call_kwargs)

    if "state" not in options:
        # A module's buffers are what it may write: known, they let the region
        # recompute without a dispatch mode (gradckpt.engine.writes).
        options["state"] = module_state(fn)
    frame = Frame(body, name=name or getattr(fn, "__name__", type(fn).__name__), **options)
    frame.save_inputs(flat)
    return frame


_LEAF_TYPES = (int, float, bool, str, type(None))


def _is_leaf(x: Any) -> bool:
    """A value pytree would not walk into: a tensor or a plain scalar."""
    return isinstance(x, torch.Tensor) or type(x) in _LEAF_TYPES


def checkpoint_sequential(
    modules: nn.Sequential | Sequence[Callable[[Any], Any]],
    segments: int,
    input: torch.Tensor,
    **kwargs: Any,
) -> Any:
    """Run a chain of modules in ``segments`` parts, checkpointing all but the last.

    Like ``torch.utils.checkpoint.checkpoint_sequential``; the last segment runs
    plainly because its activations are needed right away by backward.
    ``kwargs`` go to :func:`checkpoint` (``policy``, ``preserve_rng_state``, ...).

    Example:
        >>> y = gradckpt.checkpoint_sequential(model.layers, 4, x)
    """
    functions = list(modules.children()) if isinstance(modules, nn.Sequential) else list(modules)
    if not isinstance(segments, int) or isinstance(segments, bool):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if not 1 <= segments <= len(functions):
        raise ValueError(
            f"segments must be between 1 and the number of modules ({len(functions)}), "
            f"got {segments}"
        )
    if not isinstance(input, torch.Tensor):
        raise TypeError(
            "checkpoint_sequential takes exactly one tensor input; for several inputs "
            "call gradckpt.checkpoint on each segment"
        )
    bounds = [round(i * len(functions) / segments) for i in range(segments + 1)]

    def run(start: int, stop: int) -> Callable[[torch.Tensor], Any]:
        part = functions[start:stop]
        if all(isinstance(f, nn.Module) for f in part):
            # A module: its region knows the buffers it may write, so it recomputes
            # lean (gradckpt.engine.writes); calling it calls each module as before.
            return nn.Sequential(*part)

        def segment(x: Any) -> Any:
            for f in part:
                x = f(x)
            return x

        return segment

    x: Any = input
    for start, stop in itertools.pairwise(bounds[:-1]):
        x = checkpoint(run(start, stop), x, **kwargs)
    return run(bounds[-2], bounds[-1])(x)
