"""Brute force over the chain model, to prove the dynamic program on small chains.

:func:`evaluate` computes, in closed form, the memory a schedule needs and the
time it takes under exactly the model :mod:`gradckpt.plan.dp` optimises;
:func:`all_schedules` enumerates every schedule of a chain; :func:`brute_force`
picks the fastest that fits. Exponential: for tests on chains of a few stages.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from gradckpt.plan.dp import NESTED, TOP, Chain, Tree

__all__ = ["all_schedules", "brute_force", "evaluate"]


def evaluate(chain: Chain, tree: Tree, ctx: int = TOP, start: int = 0) -> tuple[int, float]:
    """(memory units needed, total time) of ``tree`` over stages ``start``.. in context ``ctx``.

    Example:
        >>> evaluate(chain, [("unit", 0, 0), ("unit", 1, 1)])
        (12, 3.5)
    """
    if not tree:
        return 0, 0.0
    stages = chain.stages
    head, rest = tree[0], tree[1:]
    if head[0] == "unit":
        _, a, index = head
        option = stages[a].options[index]
        need = max(option.fwd if ctx == TOP else option.fwd_nested, option.bwd)
        if not rest:
            return need, option.time
        rest_need, rest_time = evaluate(chain, rest, ctx, a + 1)
        held = option.kept + stages[a + 1].input
        return max(need, held + rest_need), option.time + rest_time
    inner = head[1]
    a = start
    j = a + _length(inner)
    if not rest:
        raise ValueError("a segment must be followed by at least one stage")
    forward = stages[a].none if ctx == TOP else stages[a].none_nested
    for s in stages[a + 1 : j]:
        forward = max(forward, (s.none if ctx == TOP else s.none_nested) + s.input)
    inner_need, inner_time = evaluate(chain, inner, NESTED, a)
    rest_need, rest_time = evaluate(chain, rest, ctx, j)
    extra = sum(s.fwd_time for s in stages[a:j])
    need = max(forward, inner_need, stages[j].input + rest_need)
    return need, extra + inner_time + rest_time


def _length(tree: Tree) -> int:
    return sum(1 if node[0] == "unit" else _length(node[1]) for node in tree)


def all_schedules(chain: Chain, a: int = 0, b: int | None = None) -> Iterator[Tree]:
    """Every schedule of stages a..b (segments need >= 2 stages and a non-empty rest)."""
    b = len(chain.stages) - 1 if b is None else b
    if a > b:
        yield []
        return
    for index in range(len(chain.stages[a].options)):
        for rest in all_schedules(chain, a + 1, b):
            yield [("unit", a, index), *rest]
    for j in range(a + 2, b + 1):
        if not all(chain.stages[s].joins_previous for s in range(a + 1, j)):
            break
        for inner in all_schedules(chain, a, j - 1):
            if len(inner) == 1 and inner[0][0] == "segment":
                continue  # a segment that is one segment is the same with an extra forward
            for rest in all_schedules(chain, j, b):
                yield [("segment", inner), *rest]


def brute_force(chain: Chain, m: int) -> tuple[float, Tree | None]:
    """The least time of any schedule needing at most ``m`` units, and that schedule."""
    best, found = math.inf, None
    for tree in all_schedules(chain):
        need, time = evaluate(chain, tree)
        if need <= m and time < best:
            best, found = time, tree
    return best, found
