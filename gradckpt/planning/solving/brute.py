"""Brute force and a plain reference DP over the chain model, to prove the fast DP.

:func:`evaluate` computes, in closed form, the memory a schedule needs and the
time it takes under exactly the model :mod:`gradckpt.planning.solving.dp` optimises;
:func:`all_schedules` enumerates every schedule of a chain; :func:`brute_force`
picks the fastest that fits (exponential: chains of a few stages).
:class:`ReferenceDP` is the same recursion as the fast DP written the obvious
way (every cell, every m, plain Python): slow, but short enough to check by
eye, so tests hold the fast DP equal to it on longer chains and real models.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from gradckpt.planning.solving.dp_chain import (
    _SEGMENT,
    NESTED,
    TOP,
    Chain,
    SegmentStep,
    Tree,
    UnitStep,
    ceil_div,
    near_div,
)

__all__ = ["ReferenceDP", "all_schedules", "brute_force", "evaluate"]


def _grads(chain: Chain, i: int, k: int) -> int:
    """Fine units of gradients left by stages i..k (0 if empty)."""
    return sum(st.grad for st in chain.stages[i : k + 1])


def evaluate(
    chain: Chain, tree: Tree, ctx: int = TOP, start: int = 0, end: int | None = None
) -> tuple[int, float]:
    """(memory units needed, total time) of ``tree`` over stages ``start..end`` in ``ctx``.

    Example:
        >>> evaluate(chain, [UnitStep(0, 0), UnitStep(1, 1)])
        (12, 3.5)
    """
    if not tree:
        return 0, 0.0
    stages, scale = chain.stages, chain.scale
    end = len(stages) - 1 if end is None else end
    head, rest = tree[0], tree[1:]
    if isinstance(head, UnitStep):
        a = head.stage
        option = stages[a].options[head.option]
        inside = _grads(chain, a + 1, end)
        forward = option.fwd if ctx == TOP else option.fwd_nested + inside
        need = ceil_div(max(forward, option.bwd + inside), scale)
        if not rest:
            return need, option.time
        rest_need, rest_time = evaluate(chain, rest, ctx, a + 1, end)
        held = option.kept + stages[a + 1].input
        return max(need, held + rest_need), option.time + rest_time
    inner = head.schedule
    a = start
    j = a + _length(inner)
    if not rest:
        raise ValueError("a segment must be followed by at least one stage")
    forward = 0
    for i in range(a, j):
        st = stages[i]
        level = st.none if ctx == TOP else st.none_nested + _grads(chain, i + 1, end)
        forward = max(forward, ceil_div(level, scale) + (st.input if i > a else 0))
    inner_need, inner_time = evaluate(chain, inner, NESTED, a, j - 1)
    rest_need, rest_time = evaluate(chain, rest, ctx, j, end)
    extra = sum(s.fwd_time for s in stages[a:j])
    shift = near_div(_grads(chain, j, end), scale)
    need = max(forward, shift + inner_need, stages[j].input + rest_need)
    return need, extra + inner_time + rest_time


def _length(tree: Tree) -> int:
    return sum(1 if isinstance(node, UnitStep) else _length(node.schedule) for node in tree)


def all_schedules(chain: Chain, a: int = 0, b: int | None = None) -> Iterator[Tree]:
    """Every schedule of stages a..b (segments need >= 2 stages and a non-empty rest)."""
    b = len(chain.stages) - 1 if b is None else b
    if a > b:
        yield []
        return
    for index in range(len(chain.stages[a].options)):
        for rest in all_schedules(chain, a + 1, b):
            yield [UnitStep(a, index), *rest]
    for j in range(a + 2, b + 1):
        if not all(chain.stages[s].joins_previous for s in range(a + 1, j)):
            break
        for inner in all_schedules(chain, a, j - 1):
            if len(inner) == 1 and isinstance(inner[0], SegmentStep):
                continue  # a segment that is one segment is the same with an extra forward
            for rest in all_schedules(chain, j, b):
                yield [SegmentStep(inner), *rest]


def brute_force(chain: Chain, m: int) -> tuple[float, Tree | None]:
    """The least time of any schedule needing at most ``m`` units, and that schedule."""
    best, found = math.inf, None
    for tree in all_schedules(chain):
        need, time = evaluate(chain, tree)
        if need <= m and time < best:
            best, found = time, tree
    return best, found


class ReferenceDP:
    """The chain DP without sharing or vectors: ``T[ctx][a][b][m]`` for every cell.

    Same interface as :class:`gradckpt.planning.solving.dp.ChainDP` (``best_time``,
    ``least_feasible``, ``schedule``) and the same candidate order, so ties
    resolve alike. O(N^3 M) Python steps: for tests only.

    Example:
        >>> ReferenceDP(chain).best_time(40) == ChainDP(chain).best_time(40)
        True
    """

    def __init__(self, chain: Chain) -> None:
        self.chain, self.n, self.size = chain, len(chain.stages), chain.capacity + 1
        self.table: dict[tuple[int, int, int], list[tuple[float, int]]] = {}
        self._cands: dict[tuple[int, int, int], list] = {}
        for length in range(self.n):  # nested cells, shorter first
            for a in range(self.n - length):
                b = a + length
                if all(chain.stages[s].joins_previous for s in range(a + 1, b + 1)):
                    self.table[NESTED, a, b] = self._cell(NESTED, a, b)
        for a in range(self.n - 1, -1, -1):
            self.table[TOP, a, self.n - 1] = self._cell(TOP, a, self.n - 1)

    def _at(self, ctx: int, a: int, b: int, m: int) -> float:
        if m < 0:
            return math.inf
        return self.table[ctx, a, b][min(m, self.size - 1)][0]

    def _cell(self, ctx: int, a: int, b: int) -> list[tuple[float, int]]:
        stages, scale = self.chain.stages, self.chain.scale
        inside = _grads(self.chain, a + 1, b)
        # Candidates as (code, need, time at m), in the fast DP's order.
        cands = []
        for k, o in enumerate(stages[a].options):
            forward = o.fwd if ctx == TOP else o.fwd_nested + inside
            need = ceil_div(max(forward, o.bwd + inside), scale)
            if a == b:
                cands.append((k, need, lambda m, o=o: o.time))
            else:
                held = o.kept + stages[a + 1].input
                time = lambda m, o=o, s=held: o.time + self._at(ctx, a + 1, b, m - s)  # noqa: E731
                cands.append((k, need, time))
        forward, extra = 0, stages[a].fwd_time
        for j in range(a + 1, b + 1):
            if j > a + 1 and not stages[j - 1].joins_previous:
                break
            st = stages[j - 1]
            level = st.none if ctx == TOP else st.none_nested + _grads(self.chain, j, b)
            forward = max(forward, ceil_div(level, scale) + (st.input if j - 1 > a else 0))
            if j == a + 1:
                continue
            extra += st.fwd_time
            shift = near_div(_grads(self.chain, j, b), scale)
            cands.append((_SEGMENT + j - a, forward, lambda m, j=j, e=extra, s=shift: (
                # Summed in the fast DP's order, so float ties fall the same way.
                self._at(ctx, j, b, m - stages[j].input)
                + self._at(NESTED, a, j - 1, min(m - s, self.size - 1)) + e
            )))  # fmt: skip
        self._cands[ctx, a, b] = cands
        row = []
        for m in range(self.size):
            best = (math.inf, -1)
            for code, need, time in cands:
                if m >= need:
                    t = time(m)
                    if t < best[0]:
                        best = (t, code)
            row.append(best)
        return row

    def best_time(self, m: int) -> float:
        return self._at(TOP, 0, self.n - 1, m)

    def least_feasible(self) -> int | None:
        row = self.table[TOP, 0, self.n - 1]
        return next((m for m, (t, _) in enumerate(row) if math.isfinite(t)), None)

    def leanest_within(self, m: int, tie: float) -> int:
        m = min(m, self.size - 1)
        best = self.best_time(m)
        if not math.isfinite(best):
            return m
        return next(k for k in range(m + 1) if self.best_time(k) <= best + tie)

    def levels_within(self, m: int, tie: float) -> list[int]:
        m = min(m, self.size - 1)
        if not math.isfinite(self.best_time(m)):
            return []
        levels: list[int] = []
        for k in range(self.leanest_within(m, tie), m):
            if self.best_time(k) == self.best_time(m):
                break  # the time is non-increasing in the budget: m's level from here on
            if k == 0 or self.best_time(k) != self.best_time(k - 1):
                levels.append(k)
        return levels

    def schedule(self, m: int, tie: float | None = None) -> Tree:
        m = min(m, self.size - 1)
        if not math.isfinite(self.best_time(m)):
            raise ValueError(f"no schedule fits in {m} units")
        if tie is None:
            return self._tree(TOP, m, 0, self.n - 1)
        return self._near(TOP, m, 0, self.n - 1, [max(0.0, tie)])

    def _tree(self, ctx: int, m: int, a: int, b: int) -> Tree:
        return self._expand(ctx, m, a, b, self.table[ctx, a, b][m][1], self._tree)

    def _near(self, ctx: int, m: int, a: int, b: int, slack: list[float]) -> Tree:
        """``ChainDP.schedule``'s rule with a tie: the first candidate within the slack
        left (``slack[0]``, spent as choices give time up)."""
        m = min(m, self.size - 1)
        found = [(code, time(m)) for code, need, time in self._cands[ctx, a, b] if m >= need]
        best = min(t for _, t in found)
        code, value = next((c, t) for c, t in found if t <= best + slack[0] + 1e-9 * abs(best))
        slack[0] = max(0.0, slack[0] - (value - best))
        return self._expand(ctx, m, a, b, code, lambda *cell: self._near(*cell, slack))

    def _expand(self, ctx: int, m: int, a: int, b: int, code: int, sub) -> Tree:
        stages = self.chain.stages
        if code < _SEGMENT:
            if a == b:
                return [UnitStep(a, code)]
            kept = stages[a].options[code].kept + stages[a + 1].input
            return [UnitStep(a, code), *sub(ctx, m - kept, a + 1, b)]
        j = a + code - _SEGMENT
        shift = near_div(_grads(self.chain, j, b), self.chain.scale)
        inner = min(m - shift, self.size - 1)
        left = sub(NESTED, inner, a, j - 1)
        return [SegmentStep(left), *sub(ctx, m - stages[j].input, j, b)]
