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

    def _fill(self) -> None:
        stages = self.chain.stages
        self._steps = torch.arange(self.size)
        self._option_arrays = [
            (
                torch.tensor([o.kept for o in st.options]),
                torch.tensor([o.fwd for o in st.options]),
                torch.tensor([o.fwd_nested for o in st.options]),
                torch.tensor([o.bwd for o in st.options]),
                torch.tensor([o.time for o in st.options], dtype=torch.float64),
            )
            for st in stages
        ]
        self._inputs = torch.tensor([st.input for st in stages])
        # Only reachable cells: top-level ones always end at the last stage, and
        # nested ones lie inside a run of stages that may share a segment.
        run_start = [0] * self.n
        for i in range(1, self.n):
            run_start[i] = run_start[i - 1] if stages[i].joins_previous else i
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny tensors: threads only add overhead
        try:
            for length in range(self.n):
                for a in range(self.n - length):
                    if run_start[a + length] <= a:
                        self._cell(NESTED, a, a + length, stages)
            for a in range(self.n - 1, -1, -1):
                self._cell(TOP, a, self.n - 1, stages)
        finally:
            torch.set_num_threads(threads)

    def _shift_rows(self, rows: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
        """Row r of the result at m is rows[r][m - shifts[r]] (inf where m < shifts[r])."""
        index = self._steps[None, :] - shifts[:, None]
        out = torch.gather(rows, 1, index.clamp(min=0))
        out[index < 0] = math.inf
        return out

    def _cell(self, ctx: int, a: int, b: int, stages: tuple[Stage, ...]) -> None:
        kept, fwd, fwd_nested, bwd, times = self._option_arrays[a]
        need = torch.maximum(fwd if ctx == TOP else fwd_nested, bwd)
        if a == b:
            cands = times[:, None].expand(len(times), self.size).clone()
        else:
            rest = self.time[ctx, a + 1, b].expand(len(times), self.size)
            cands = self._shift_rows(rest, kept + self._inputs[a + 1]) + times[:, None]
        codes = list(range(len(times)))
        # Segments a..j-1 (at least two stages, the rest non-empty), all j at once.
        last = a + 1
        while last + 1 <= b and stages[last].joins_previous:
            last += 1
        if last > a + 1:
            js = torch.arange(a + 2, last + 1)
            nones = [st.none if ctx == TOP else st.none_nested for st in stages[a:last]]
            firsts = [nones[0]] + [nones[i] + stages[a + i].input for i in range(1, len(nones))]
            seg_need = torch.tensor(firsts).cummax(0).values[1:]
            extra = torch.tensor([st.fwd_time for st in stages[a:last]], dtype=torch.float64)
            extra = extra.cumsum(0)[1:]
            rest = self._shift_rows(self.time[ctx, js, b], self._inputs[js])
            cands = torch.cat([cands, rest + self.time[NESTED, a, js - 1] + extra[:, None]])
            need = torch.cat([need, seg_need])
            codes += [_SEGMENT + int(j) for j in js]
        cands[self._steps[None, :] < need[:, None]] = math.inf
        best, which = cands.min(0)
        self.time[ctx, a, b] = best
        chosen = torch.tensor(codes, dtype=torch.int32)[which]
        self.choice[ctx, a, b] = torch.where(torch.isfinite(best), chosen, -1)

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
