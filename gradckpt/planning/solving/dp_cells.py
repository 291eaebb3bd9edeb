"""The tables of :class:`gradckpt.planning.solving.dp.ChainDP`, filled with identical cells shared.

A NESTED cell ``a..b`` (a recompute of stages a..b) depends only on its own
stages: stage ``a`` without its input, gradient and join flag (nothing in the
cell reads them), and stages a+1..b in full. Cells are keyed by that sequence,
built incrementally (the key of ``a..b`` is the key of ``a..b-1`` plus stage
``b``), and each distinct key is filled once, by increasing length, from the
keys of its sub-cells. In a transformer's run of N identical blocks the
distinct nested cells number about 3N (interior cells by length, plus those
touching a differing first or last block) instead of N^2/2, and each costs one
vector per split point: O(N^2) vectors in all. A chain of all-different stages
falls back to every cell, as before; the result is the same either way.

TOP cells (the step's own forward) always end at the last stage: there are N,
stored by their first stage.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from gradckpt.planning.solving.dp_chain import (
    _SEGMENT,
    NESTED,
    TOP,
    Chain,
    Stage,
    ceil_div,
    near_div,
)

__all__ = ["CellTables"]

_CHUNK = 32  # segment rows per block of work: windows of nearby rows are alike


class CellTables:
    """Best time and choice per (context, cell, m); built on construction."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.stages = chain.stages
        self.n, self.size, self.scale = len(chain.stages), chain.capacity + 1, chain.scale
        self._prefix = [0]  # gradients left by stages 0..i-1
        for st in self.stages:
            self._prefix.append(self._prefix[-1] + st.grad)
        self._steps = torch.arange(self.size)
        self._inputs = torch.tensor([st.input for st in self.stages])
        self._prefix_t = torch.tensor(self._prefix)
        self._none_top = ceil_div(torch.tensor([st.none for st in self.stages]), self.scale)
        self._none_nested = torch.tensor([st.none_nested for st in self.stages])
        self._fwd_time = torch.tensor([st.fwd_time for st in self.stages], dtype=torch.float64)
        self._options = [self._option_arrays(st) for st in self.stages]
        self._key_cells()
        # Tables are stored padded: inf on the left (m < 0) and the last entry
        # repeated on the right (m past the grid), so a shifted read is one gather.
        self._left, right = self._padding()
        width = self._left + self.size + right
        self._nested = torch.full((self.cells, width), math.inf, dtype=torch.float64)
        self._top = torch.full((self.n, width), math.inf, dtype=torch.float64)
        self.nested_choice = torch.full((self.cells, self.size), -1, dtype=torch.int32)
        self.top_choice = torch.full((self.n, self.size), -1, dtype=torch.int32)
        self.top_time = self._top[:, self._left : self._left + self.size]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small vectors: threads only add overhead
        try:
            for a, b in self._representatives:
                uid = int(self._uid[a, b])
                self.nested_choice[uid] = self._store(self._nested[uid], *self._cell(NESTED, a, b))
            for a in range(self.n - 1, -1, -1):
                self.top_choice[a] = self._store(self._top[a], *self._cell(TOP, a, self.n - 1))
        finally:
            torch.set_num_threads(threads)

    # ------------------------------------------------------------- structure

    def _padding(self) -> tuple[int, int]:
        """Columns needed left and right of the grid for every shift a cell reads with."""
        stages, scale = self.stages, self.scale
        kept = max(o.kept for st in stages for o in st.options)
        inputs = max(st.input for st in stages)
        grads = [st.grad for st in stages]
        ahead = near_div(sum(g for g in grads if g > 0), scale)
        behind = -near_div(sum(g for g in grads if g < 0), scale)
        # An option that frees its input (offloaded boundary) holds less than nothing:
        # its rest is read to the right of m.
        freed = -min(0, min(o.kept for st in stages for o in st.options))
        return max(0, kept) + max(0, inputs) + ahead + 1, behind + freed + 1

    def _store(self, row: torch.Tensor, best: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        left = self._left
        row[left : left + self.size] = best
        row[left + self.size :] = best[-1]
        return choice

    @staticmethod
    def _option_arrays(st: Stage) -> tuple[torch.Tensor, ...]:
        opts = st.options
        return (
            torch.tensor([o.kept for o in opts]),
            torch.tensor([o.fwd for o in opts]),
            torch.tensor([o.fwd_nested for o in opts]),
            torch.tensor([o.bwd for o in opts]),
            torch.tensor([o.time for o in opts], dtype=torch.float64),
        )

    def _key_cells(self) -> None:
        """Give every reachable nested cell the id of its distinct stage sequence."""
        stages, n = self.stages, self.n
        full: dict[Stage, int] = {}
        # Each stage hashed once: a stage's hash walks all its options.
        stage_id = [full.setdefault(st, len(full)) for st in stages]
        head: dict[Stage, int] = {}
        keys: dict[tuple, int] = {}
        self._uid = torch.full((n, n), -1, dtype=torch.int64)
        by_length: dict[int, list[tuple[int, int]]] = {}
        for a in range(n - 1):  # a nested cell never ends at the last stage: its rest is empty
            # What a cell does not read of its first stage must not split keys.
            first = replace(stages[a], input=0, joins_previous=False, grad=0)
            key = ("head", head.setdefault(first, len(head)))
            b = a
            while True:
                if key not in keys:
                    keys[key] = len(keys)
                    by_length.setdefault(b - a, []).append((a, b))
                self._uid[a, b] = keys[key]
                b += 1
                # Nested cells lie inside a run of stages that may share a segment.
                if b >= n - 1 or not stages[b].joins_previous:
                    break
                key = (keys[key], stage_id[b])
        self.cells = len(keys)
        self._representatives = [cell for length in sorted(by_length) for cell in by_length[length]]

    def grad_shift(self, j: int, b: int) -> int:
        """Grid units of gradients stages j..b leave live while a segment ending at j-1 recomputes."""
        return near_div(self._prefix[b + 1] - self._prefix[j], self.scale)

    def choice(self, ctx: int, a: int, b: int, m: int) -> int:
        if ctx == TOP:
            return int(self.top_choice[a, m])
        return int(self.nested_choice[int(self._uid[a, b]), m])

    # ------------------------------------------------------------------ fill

    def _read(self, table: torch.Tensor, rows: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
        """Row r of the result at m is table[rows[r]] at m - shifts[r]: one gather of the
        flat padded table (inf below m = 0, the last entry past the grid)."""
        return self._take(table, rows, shifts, self._steps)

    def _option_terms(self, ctx: int, a: int, b: int) -> tuple[torch.Tensor, ...]:
        """Per option of stage ``a`` in cell a..b: its requirement (grid units), what it
        holds while the rest runs (the rest's shift), and its time."""
        kept, fwd, fwd_nested, bwd, times = self._options[a]
        # The gradients stages a+1..b left are live during a's backward.
        inside = self._prefix[b + 1] - self._prefix[a + 1]
        forward = fwd if ctx == TOP else fwd_nested + inside
        need = ceil_div(torch.maximum(forward, bwd + inside), self.scale)
        shift = kept + int(self._inputs[a + 1]) if a < b else kept
        return need, shift, times

    def _segment_terms(self, ctx: int, a: int, b: int) -> tuple | None:
        """Segments a..j-1 (at least two stages, the rest non-empty), all j at once: where
        their rest and recompute are read, their forward time and requirement (None: no
        segment starts at ``a`` in this cell)."""
        stages, scale = self.stages, self.scale
        last = a + 1
        while last + 1 <= b and stages[last].joins_previous:
            last += 1
        if last <= a + 1:
            return None
        inputs = self._inputs[a:last].clone()
        inputs[0] = 0  # the segment's own input is held by the cell's caller
        if ctx == TOP:
            levels = self._none_top[a:last]
        else:
            later = self._prefix_t[b + 1] - self._prefix_t[a + 1 : last + 1]
            levels = ceil_div(self._none_nested[a:last] + later, scale)
        seg_need = (levels + inputs).cummax(0).values[1:]
        extra = self._fwd_time[a:last].cumsum(0)[1:]
        js = torch.arange(a + 2, last + 1)
        shifts = near_div(self._prefix_t[b + 1] - self._prefix_t[js], scale)
        table = self._top if ctx == TOP else self._nested
        rest = (table, js if ctx == TOP else self._uid[js, b], self._inputs[js])
        inner = (self._nested, self._uid[a, js - 1], shifts)
        return rest, inner, extra, seg_need

    def _cell(self, ctx: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Best time and choice code at every m for stages a..b in context ``ctx``."""
        need, shift, times = self._option_terms(ctx, a, b)
        table = self._top if ctx == TOP else self._nested
        if a == b:
            cands = times[:, None].expand(len(times), self.size).clone()
        else:
            row = torch.full_like(shift, self._row(ctx, a + 1, b))
            cands = self._read(table, row, shift) + times[:, None]
        cands.masked_fill_(self._steps[None, :] < need[:, None], math.inf)
        best, which = cands.min(0)
        segments = self._segment_terms(ctx, a, b)
        if segments is not None:
            seg_best, seg_which = self._segments(best, *segments)
            # Ties go to the stage alone: candidates are ranked options first, then j.
            better = seg_best < best
            best = torch.where(better, seg_best, best)
            which = torch.where(better, seg_which + _SEGMENT + 2, which)
        return best, torch.where(torch.isfinite(best), which.to(torch.int32), -1)

    def candidates(self, ctx: int, a: int, b: int, m: int) -> list[tuple[int, float]]:
        """Every choice of cell a..b at ``m`` that fits, with its time, in the order ties
        go: the stage's options first, then segments, shortest first. Times are summed
        as the fill sums them, so the best of them is the table's value bit for bit."""
        need, shift, times = self._option_terms(ctx, a, b)
        at = self._steps[m : m + 1]
        if a == b:
            values = times.clone()
        else:
            table = self._top if ctx == TOP else self._nested
            row = torch.full_like(shift, self._row(ctx, a + 1, b))
            values = self._take(table, row, shift, at)[:, 0] + times
        values.masked_fill_(m < need, math.inf)
        found = [(code, float(v)) for code, v in enumerate(values.tolist())]
        segments = self._segment_terms(ctx, a, b)
        if segments is not None:
            rest, inner, extra, seg_need = segments
            seg = self._take(*rest, at)[:, 0]
            seg += self._take(*inner, at)[:, 0]
            seg += extra
            seg.masked_fill_(m < seg_need, math.inf)
            found += [(_SEGMENT + 2 + r, float(v)) for r, v in enumerate(seg.tolist())]
        return [(code, v) for code, v in found if math.isfinite(v)]

    def _segments(self, alone, rest, inner, extra, need) -> tuple[torch.Tensor, torch.Tensor]:
        """Best segment candidate and its row at every m, computed only where it can win.

        Tables fall with m, so segment row r never costs less than ``floor_r`` =
        extra + the least of its rest + the least of its recompute. Where the best
        stage-alone candidate ``alone`` is already below that (``alone`` falls too:
        from some m on), the row cannot be chosen and is not computed. Rows are taken
        in chunks, each over the columns some row of it may still win.
        """
        size = self.size
        last = self._left + size - 1  # the least value of a padded row sits at its end
        floor = extra + rest[0].view(-1)[rest[1] * rest[0].shape[1] + last]
        floor += inner[0].view(-1)[inner[1] * inner[0].shape[1] + last]
        # Row r may win only for m < stop_r: where alone[m] >= floor_r (rounding margin).
        stop = size - torch.searchsorted(alone.flip(0), floor * (1 - 1e-12), side="left")
        best = torch.full((size,), math.inf, dtype=torch.float64)
        which = torch.zeros(size, dtype=torch.int64)
        for lo in range(0, len(extra), _CHUNK):
            hi = lo + _CHUNK
            # A calibrated requirement may be below zero (the model holds more than the
            # step did): such a row fits from m = 0.
            c0, c1 = max(0, int(need[lo:hi].min())), int(stop[lo:hi].max())
            uniform = int(need[lo:hi].max()) <= c0  # then no column below a row's need
            if c1 <= c0:
                continue
            steps = self._steps[c0:c1]
            cand = self._take(rest[0], rest[1][lo:hi], rest[2][lo:hi], steps)
            cand += self._take(inner[0], inner[1][lo:hi], inner[2][lo:hi], steps)
            cand += extra[lo:hi, None]
            if not uniform:
                cand.masked_fill_(steps[None, :] < need[lo:hi, None], math.inf)
            chunk_best, chunk_which = cand.min(0)
            better = chunk_best < best[c0:c1]  # earlier rows win ties
            best[c0:c1] = torch.where(better, chunk_best, best[c0:c1])
            which[c0:c1] = torch.where(better, chunk_which + lo, which[c0:c1])
        return best, which

    def _take(self, table, rows, shifts, steps) -> torch.Tensor:
        """Row r of the result is table[rows[r]] at ``steps`` - shifts[r]: the flat padded
        table's windows of len(steps) are a view, so this is one gather of whole windows
        (no index per element)."""
        start = rows * table.shape[1] + (self._left + int(steps[0])) - shifts
        return table.view(-1).unfold(0, len(steps), 1)[start]

    def _row(self, ctx: int, a: int, b: int) -> int:
        return a if ctx == TOP else int(self._uid[a, b])
