"""Blocks inside blocks: which level covers the step's compute, seen by running the step.

Structure alone finds repeated classes at several depths: Swin's stages hold
repeated blocks, a decoder layer holds a ``ModuleList`` of repeated experts. The
finer level gives the planner more choices, but only when it covers its parent:
every op the parent runs must then belong to some unit. A stage's forward only
calls its blocks (and a downsampling module, a unit of its own), so the blocks
cover it. A decoder layer's forward routes tokens to its experts, weighs and sums
their outputs and adds the residuals itself: with the experts as blocks, all of
that runs outside every unit and is always kept.

:func:`settle_nested` runs the step's forward once without grad (nothing is kept
for backward; under fake tensors nothing is allocated), counts the bytes every
op writes by the module running it, and takes the parent wherever the finer
blocks write less than :data:`COVER_SHARE` of what the parent writes in all.
Decided per parent class, so all layers of a model get the same kind of units.

Example:
    >>> blocks, parents = settle_nested(model, ["layers.0", "layers.0.moe.experts.0"], step)
    >>> blocks[:1], parents
    (['layers.0'], [])
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["COVER_SHARE", "nested", "settle_nested", "written_by_module"]

#: The finer blocks must write at least this share of their parent's bytes to be
#: the blocks. Where they are the blocks a person names, what they leave is a
#: downsampling layer or a concatenation (Swin stages: 96%, MONAI's skip
#: connections: 94%); where they are parts, a residual stream, a SwiGLU product,
#: attention or the expert routing (a Llama layer split at its projections: 34%,
#: a decoder layer at its experts: 51%; measured on gradckpt.testing.wild's layouts).
COVER_SHARE = 0.8


def nested(paths: list[str]) -> bool:
    """Whether some path in ``paths`` lies inside another.

    Example:
        >>> nested(["a", "a.b"]), nested(["a.0", "a.1"])
        (True, False)
    """
    chosen = set(paths)
    return any(_ancestors(p) & chosen for p in paths)


def _ancestors(path: str) -> set[str]:
    parts = path.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


class _WrittenBytes(TorchDispatchMode):
    """Bytes each op writes, by the module path running it (the innermost)."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.written: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten(out)
        nbytes = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        self.written[self.stack[-1] if self.stack else ""] += nbytes
        return out


def written_by_module(model: nn.Module, run: Callable[[], Any]) -> dict[str, int]:
    """Bytes written by each module's own code (not its children's) in one ``run()`` without grad.

    Example:
        >>> written_by_module(model, step)["layers.0"]  # the residual adds, say
        131072
    """
    stack: list[str] = []
    handles = []
    for name, module in model.named_modules():

        def enter(module: nn.Module, args: Any, name: str = name) -> None:
            stack.append(name)

        def leave(module: nn.Module, args: Any, out: Any) -> None:
            stack.pop()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    counter = _WrittenBytes(stack)
    try:
        with torch.no_grad(), counter:
            run()
    finally:
        for handle in handles:
            handle.remove()
    return dict(counter.written)


def settle_nested(
    model: nn.Module, candidates: list[str], run: Callable[[], Any]
) -> tuple[list[str], list[str]]:
    """The candidates with each nested level settled: (blocks in model order, parents kept out).

    A parent block (a candidate holding others) replaces the finer candidates inside
    it when they write less than :data:`COVER_SHARE` of the bytes it writes; the
    finer ones stay otherwise, and the parents they stayed in are returned (the
    budget error names them). Deepest parents are settled first, one class at a time.

    Example:
        >>> settle_nested(swin, ["layers.0", "layers.0.blocks.0", ...], step)[1][:1]
        ['layers.0']
    """
    written = written_by_module(model, run)
    modules = dict(model.named_modules())
    chosen = list(candidates)
    parents = [p for p in chosen if any(q.startswith(p + ".") for q in chosen)]
    kept_out: list[str] = []
    by_class: dict[type, list[str]] = defaultdict(list)
    for p in parents:
        by_class[type(modules[p])].append(p)
    depth = {cls: max(p.count(".") for p in ps) for cls, ps in by_class.items()}
    for cls in sorted(by_class, key=lambda c: -depth[c]):
        outers = [p for p in by_class[cls] if p in chosen]
        covered = total = 0
        for outer in outers:
            inner = [q for q in chosen if q.startswith(outer + ".")]
            for path, nbytes in written.items():
                if path == outer or path.startswith(outer + "."):
                    total += nbytes
                    covered += nbytes if any(_within(path, q) for q in inner) else 0
        if total and covered < COVER_SHARE * total:
            chosen = [q for q in chosen if not any(q.startswith(o + ".") for o in outers)]
        else:
            kept_out += outers
    order = {name: i for i, name in enumerate(modules)}
    final = [p for p in chosen if not any(q.startswith(p + ".") for q in chosen)]
    return sorted(final, key=order.__getitem__), sorted(set(kept_out) - set(final))


def _within(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")
