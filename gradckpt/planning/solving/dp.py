"""The reference solver: a chain dynamic program over units (in the spirit of rotor).

The model is a chain of stages 0..L-1; stage ``l`` reads ``x[l-1]`` (``input``
units) and writes ``x[l]``. ``Opt(ctx, m, a, b)`` is the least time to run the
forward and then the backward of stages a..b when ``x[a-1]`` is already held
and at most ``m`` more memory units are free. Its first item is either

1. stage ``a`` alone, in one of its options (keep everything, recompute, or a
   selective save set): it needs ``need(a, b)`` during its forward and
   backward, and holds ``kept`` plus its output while the rest runs::

       time(a, c) + Opt(ctx, m - kept(a, c) - input(a+1), a+1, b)

2. a segment ``a..j-1`` run once keeping nothing, whose output is held while
   the rest runs, and which is recomputed in backward by its own schedule::

       sum(fwd_time[a..j-1]) + Opt(ctx, m - input(j), j, b)
                             + Opt(NESTED, m - grads(j..b), a, j-1)

``ctx`` is TOP for the step's own forward and NESTED inside a recompute (which
runs during backward, where gradients and the incoming gradient are live).

Requirements are given in fine units (bytes for real chains) and rounded up to
grid units per cell. What a stage's backward leaves behind (its parameters'
gradients, ``Stage.grad``) is not baked into each stage: a stage's requirement
in cell ``a..b`` adds the gradients of ``a+1..b`` only, and a nested cell is
shifted by the gradients of the stages after it. That makes a cell's table
depend on its own stages alone, so the cells of a run of identical blocks that
have the same length are one table, computed once (see :mod:`dp_cells`): a
transformer of N layers costs O(N^2) vectors instead of O(N^3).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gradckpt.planning.solving.dp_cells import CellTables
from gradckpt.planning.solving.dp_chain import (
    _SEGMENT,
    NESTED,
    TOP,
    Chain,
    SegmentStep,
    Tree,
    UnitStep,
)

__all__ = ["ChainDP"]


class ChainDP:
    """Fill the tables once; then :meth:`schedule` for any budget in grid units.

    Example:
        >>> dp = ChainDP(chain)
        >>> dp.best_time(100), dp.schedule(100)
    """

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.n, self.size = len(chain.stages), chain.capacity + 1
        self._cells = CellTables(chain)

    # ---------------------------------------------------------------- queries

    def best_time(self, m: int) -> float:
        """Least total time within ``m`` units (inf if nothing fits)."""
        if m < 0:
            return math.inf
        return float(self._cells.top_time[0, min(m, self.size - 1)])

    def least_feasible(self) -> int | None:
        """The smallest ``m`` for which some schedule fits, or None."""
        feasible = torch.isfinite(self._cells.top_time[0]).nonzero()
        return int(feasible[0]) if len(feasible) else None

    def leanest_within(self, m: int, tie: float) -> int:
        """The least budget (grid units, at most ``m``) whose best time is within ``tie``
        seconds of ``m``'s: of plans equally fast within ``tie``, the one that holds least.

        Example:
            >>> dp.schedule(dp.leanest_within(100, 0.002))
        """
        m = min(m, self.size - 1)
        best = self.best_time(m)
        if not math.isfinite(best):
            return m
        within = (self._cells.top_time[0, : m + 1] <= best + tie).nonzero()
        return int(within[0])

    def levels_within(self, m: int, tie: float) -> list[int]:
        """The least budget of each best time within ``tie`` seconds of ``m``'s, leanest
        first, ``m``'s own level left out: the schedules that hold less for little time.

        Example:
            >>> [dp.schedule(k) for k in dp.levels_within(100, 0.002)]
        """
        m = min(m, self.size - 1)
        best = self.best_time(m)
        if not math.isfinite(best):
            return []
        times = self._cells.top_time[0, : m + 1].tolist()
        own = times[m]
        levels = []
        for k in range(self.leanest_within(m, tie), m + 1):
            if times[k] != own and (not levels or times[k] != times[levels[-1]]):
                levels.append(k)
        return levels

    def schedule(self, m: int, tie: float | None = None) -> Tree:
        """The optimal schedule within ``m`` units (ValueError if none fits).

        With ``tie`` (seconds), a near-optimal schedule that does not move with noise:
        each choice, from the first stage on, takes the first candidate in a fixed
        order (a stage's options, then segments, shortest first) whose time is within
        what is left of ``tie`` of the best, and what it gives up is spent from it.
        The schedule's time is at most ``best_time(m) + tie``, however many choices
        there are; candidates nearer than ``tie`` (float rounding, two plans priced
        alike from noisy op times) no longer decide by which is a hair cheaper.

        Example:
            >>> dp.schedule(100, tie=0.005 * dp.best_time(dp.size - 1))
        """
        m = min(m, self.size - 1)
        if not math.isfinite(self.best_time(m)):
            raise ValueError(f"no schedule fits in {m} units")
        if tie is None:
            return self._tree(TOP, m, 0, self.n - 1)
        return self._near_tree(TOP, m, 0, self.n - 1, max(0.0, tie))[0]

    def _tree(self, ctx: int, m: int, a: int, b: int) -> Tree:
        code = self._cells.choice(ctx, a, b, m)
        if code < 0:
            raise AssertionError(f"internal: no choice recorded for stages {a}..{b} at {m}")
        return self._expand(ctx, m, a, b, code, self._tree)

    def _near_tree(self, ctx: int, m: int, a: int, b: int, slack: float) -> tuple[Tree, float]:
        """The schedule of cell a..b at ``m`` within ``slack`` of its best, and the slack left."""
        found = self._cells.candidates(ctx, a, b, m)
        best = min(v for _, v in found)
        # Sums of the same terms in another order differ in the last bits: no win.
        within = best + slack + 1e-9 * abs(best)
        code, value = next((c, v) for c, v in found if v <= within)
        left = max(0.0, slack - (value - best))

        def sub(ctx: int, m: int, a: int, b: int) -> Tree:
            nonlocal left  # sub-cells are scheduled in turn, each spending from it
            tree, left = self._near_tree(ctx, m, a, b, left)
            return tree

        return self._expand(ctx, m, a, b, code, sub), left

    def _expand(
        self, ctx: int, m: int, a: int, b: int, code: int, sub: Callable[[int, int, int, int], Tree]
    ) -> Tree:
        """The schedule of cell a..b at ``m`` whose first choice is ``code``, its sub-cells
        scheduled by ``sub(ctx, m, a, b)``."""
        stages = self.chain.stages
        if code < _SEGMENT:
            item = UnitStep(a, code)
            if a == b:
                return [item]
            kept = stages[a].options[code].kept + stages[a + 1].input
            # An option that frees its input may leave more than the grid holds: the
            # tables are flat past it (the padding), so the choice there is the last one.
            return [item, *sub(ctx, min(m - kept, self.size - 1), a + 1, b)]
        j = a + code - _SEGMENT
        inner = min(m - self._cells.grad_shift(j, b), self.size - 1)
        recompute = sub(NESTED, inner, a, j - 1)
        return [SegmentStep(recompute), *sub(ctx, m - stages[j].input, j, b)]
