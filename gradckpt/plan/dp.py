"""The reference solver: a chain dynamic program over units (in the spirit of rotor).

The model is a chain of stages 0..L-1; stage ``l`` reads ``x[l-1]`` (``input``
bytes) and writes ``x[l]``. ``Opt(ctx, m, a, b)`` is the least time to run the
forward and then the backward of stages a..b when ``x[a-1]`` is already held
and at most ``m`` more memory units are free. Its first item is either

1. stage ``a`` alone, in one of its options (keep everything, recompute, or a
   selective save set): it needs ``fwd`` during its forward and ``bwd`` during
   its backward, and holds ``kept`` plus its output while the rest runs::

       time(a, c) + Opt(ctx, m - kept(a, c) - input(a+1), a+1, b)

2. a segment ``a..j-1`` run once keeping nothing (each stage needs ``none``
   plus the output of the stage before it), whose output is held while the
   rest runs, and which is recomputed in backward by its own schedule::

       sum(fwd_time[a..j-1]) + Opt(ctx, m - input(j), j, b) + Opt(NESTED, m, a, j-1)

``ctx`` is TOP for the step's own forward and NESTED inside a recompute (which
runs during backward, where other memory is live: gradients, the incoming
gradient), so stages carry a forward requirement for each context. Tables are
filled for every ``m`` on a grid at once (vectors over m), by increasing
segment length, so one solve answers every budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["NESTED", "TOP", "Chain", "ChainDP", "Option", "Stage", "Tree"]

TOP, NESTED = 0, 1
_SEGMENT = 1 << 16  # choice codes at or above this are segments ending before j = code - _SEGMENT


@dataclass(frozen=True)
class Option:
    """One way to run a stage (memory in grid units, time in seconds)."""

    name: str
    kept: int
    fwd: int
    fwd_nested: int
    bwd: int
    time: float


@dataclass(frozen=True)
class Stage:
    input: int
    options: tuple[Option, ...]
    none: int
    none_nested: int
    fwd_time: float
    joins_previous: bool


@dataclass(frozen=True)
class Chain:
    stages: tuple[Stage, ...]
    capacity: int  # the largest m the tables cover


# A schedule: ("unit", stage, option) or ("segment", [schedule of a..j-1]).
Tree = list[Union[tuple[str, int, int], tuple[str, list]]]  # noqa: UP007


class ChainDP:
    """Fill the tables once; then :meth:`schedule` for any budget in grid units.

    Example:
        >>> dp = ChainDP(chain)
        >>> dp.best_time(100), dp.schedule(100)
    """

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        n, size = len(chain.stages), chain.capacity + 1
        self.n, self.size = n, size
        self.time = torch.full((2, n, n, size), math.inf, dtype=torch.float64)
        self.choice = torch.full((2, n, n, size), -1, dtype=torch.int32)
        self._fill()

    # ----------------------------------------------------------------- tables

    def _shifted(self, ctx: int, a: int, b: int, by: int) -> torch.Tensor:
        """Opt(ctx, m - by, a, b) as a vector over m (inf where m < by)."""
        out = torch.full((self.size,), math.inf, dtype=torch.float64)
        if by < self.size:
            out[by:] = self.time[ctx, a, b, : self.size - by]
        return out

    def _fill(self) -> None:
        stages = self.chain.stages
        for length in range(self.n):
            for a in range(self.n - length):
                b = a + length
                for ctx in (NESTED, TOP):
                    self._cell(ctx, a, b, stages)

    def _cell(self, ctx: int, a: int, b: int, stages: tuple[Stage, ...]) -> None:
        best = self.time[ctx, a, b]
        choice = self.choice[ctx, a, b]
        stage = stages[a]
        for index, option in enumerate(stage.options):
            need = max(option.fwd if ctx == TOP else option.fwd_nested, option.bwd)
            if a == b:
                cand = torch.full((self.size,), option.time, dtype=torch.float64)
            else:
                cand = self._shifted(ctx, a + 1, b, option.kept + stages[a + 1].input) + option.time
            cand[: min(need, self.size)] = math.inf
            self._take(best, choice, cand, index)
        # Segments a..j-1 with at least two stages and a non-empty rest.
        need = stage.none if ctx == TOP else stage.none_nested
        extra_time = stage.fwd_time
        for j in range(a + 2, b + 1):
            last = stages[j - 1]
            if not last.joins_previous:
                break
            need = max(need, (last.none if ctx == TOP else last.none_nested) + last.input)
            extra_time += last.fwd_time
            cand = (
                self._shifted(ctx, j, b, stages[j].input) + self.time[NESTED, a, j - 1] + extra_time
            )
            cand[: min(need, self.size)] = math.inf
            self._take(best, choice, cand, _SEGMENT + j)

    @staticmethod
    def _take(best: torch.Tensor, choice: torch.Tensor, cand: torch.Tensor, code: int) -> None:
        better = cand < best
        best[better] = cand[better]
        choice[better] = code

    # ---------------------------------------------------------------- queries

    def best_time(self, m: int) -> float:
        """Least total time within ``m`` units (inf if nothing fits)."""
        return float(self.time[TOP, 0, self.n - 1, min(m, self.size - 1)])

    def least_feasible(self) -> int | None:
        """The smallest ``m`` for which some schedule fits, or None."""
        feasible = torch.isfinite(self.time[TOP, 0, self.n - 1]).nonzero()
        return int(feasible[0]) if len(feasible) else None

    def schedule(self, m: int) -> Tree:
        """The optimal schedule within ``m`` units (ValueError if none fits)."""
        m = min(m, self.size - 1)
        if not math.isfinite(self.best_time(m)):
            raise ValueError(f"no schedule fits in {m} units")
        return self._tree(TOP, m, 0, self.n - 1)

    def _tree(self, ctx: int, m: int, a: int, b: int) -> Tree:
        code = int(self.choice[ctx, a, b, m])
        stages = self.chain.stages
        if code < 0:
            raise AssertionError(f"internal: no choice recorded for stages {a}..{b} at {m}")
        if code < _SEGMENT:
            item = ("unit", a, code)
            if a == b:
                return [item]
            kept = stages[a].options[code].kept + stages[a + 1].input
            return [item, *self._tree(ctx, m - kept, a + 1, b)]
        j = code - _SEGMENT
        left = self._tree(NESTED, m, a, j - 1)
        return [("segment", left), *self._tree(ctx, m - stages[j].input, j, b)]
