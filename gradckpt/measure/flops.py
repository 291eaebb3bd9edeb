"""Deterministic work counts: FLOPs per op type and ATen op calls.

Both run ``fn`` under a dispatch mode, so they see everything it runs,
including backward (when ``fn`` calls it) and the recompute of checkpointed
regions. Tests assert recompute with these instead of wall-clock time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from gradckpt.engine import counts_as_op

__all__ = ["FlopCount", "count_flops", "count_matmul_flops", "count_ops"]


@dataclass(frozen=True)
class FlopCount:
    """Total FLOPs and FLOPs per op packet (``"aten.mm"``), as torch's FlopCounterMode counts.

    Example:
        >>> count_flops(torch.mm, torch.ones(2, 3), torch.ones(3, 4))
        FlopCount(total=48, by_op={'aten.mm': 48})
    """

    total: int
    by_op: dict[str, int] = field(default_factory=dict, hash=False)

    def __getitem__(self, op: str) -> int:
        """FLOPs of one op packet, 0 if it did not run (``fc["aten.mm"]``)."""
        return self.by_op.get(op, 0)


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> FlopCount:
    """Run ``fn(*args, **kwargs)`` and count its FLOPs (forward, backward, recompute).

    Only ops torch has a FLOP formula for count (matmuls, convolutions,
    attention); elementwise ops count zero.

    Example:
        >>> fc = count_flops(lambda: model(x).sum().backward())
        >>> fc.total, fc["aten.mm"]
    """
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items() if n}
    return FlopCount(total=int(counter.get_total_flops()), by_op=by_op)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[Any] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if counts_as_op(func):
            self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Counter[str]:
    """Run ``fn(*args, **kwargs)`` and count the ATen op overloads it executes.

    Keys are overload names (``"aten.mm.default"``). Metadata-only ops and
    detaches are skipped, exactly as the engine skips them when it numbers a
    region's ops, so counts line up with plans.

    Example:
        >>> ops = count_ops(lambda: model(x).sum().backward())
        >>> ops["aten.mm.default"]
    """
    counter = _OpCounter()
    with counter:
        fn(*args, **kwargs)
    names: Counter[str] = Counter()
    for func, n in counter.counts.items():
        names[str(func)] += n
    return names


_MATMULS = frozenset({"mm", "addmm", "addmm_"})


class _MatmulFlops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _MATMULS:
            a, b = args[:2] if name == "mm" else args[1:3]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def count_matmul_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Run ``fn(*args, **kwargs)`` and count the FLOPs of its 2-D matmuls.

    ``mm`` and ``addmm`` in every form, ``out=`` and in-place included (torch's
    FlopCounterMode misses an ``mm`` written into a slice of a buffer, which the
    chunked head's backward does).

    Example:
        >>> count_matmul_flops(torch.mm, torch.ones(2, 3), torch.ones(3, 4))
        48
    """
    counter = _MatmulFlops()
    with counter:
        fn(*args, **kwargs)
    return counter.flops
