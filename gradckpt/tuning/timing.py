"""Step and op times at any micro-batch size, from real profiles at one or two small ones.

Fake profiles give every candidate micro-batch's ops, sizes and what backward
keeps, exactly and without memory; their times are estimates from FLOPs and
bytes. Real times come from the plain step profiled for real at the two
smallest candidate sizes that fit the budget plainly (``b1 < b2``):

* **the step**: its measured time (unrecorded plain steps, ``Profile.step_time``)
  is taken as linear in the batch, ``T(b) = T(b1) + s * (b - b1)`` with
  ``s = max(0, (T(b2) - T(b1)) / (b2 - b1))``: a fixed cost per micro-batch
  (Python, launches, the loss) plus a cost per sample, which is what makes a
  larger micro-batch pay or not; below ``b1`` no less than ``T(b1) * b / b1``
  (a fixed cost is not negative: two noisy times can make it so);
* **each op**, which prices what a plan recomputes: when the ops of the
  profiles line up (same count and names), op ``i`` is linear in the batch the
  same way from its recorded times; otherwise the fake estimate. Either way
  the ops are scaled to sum to ``T(b)`` (recorded op times carry the
  recorder's own overhead; only their proportions are used);
* with one real size only, ``s = T(b1) / b1`` (time per sample constant); with
  none, the fake estimates stand (said in the result).

Cost: two real profiles with ``repeats=2`` (five passes each) at small sizes.

Example:
    >>> times = BatchTimes.fit({1: prof_1, 2: prof_2}, {1: fake_1, 2: fake_2})
    >>> timed = times.at(fake_8, 8)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gradckpt.profiling.records import Profile, retimed

__all__ = ["BatchTimes"]


def _names(p: Profile) -> tuple[str, ...]:
    return tuple(op.name for op in p.ops)


@dataclass(frozen=True)
class BatchTimes:
    """Real profiles at one or two sizes (and the fake ones at the same sizes)."""

    real: tuple[tuple[int, Profile], ...]
    fake: tuple[tuple[int, Profile], ...]

    @classmethod
    def fit(cls, real: dict[int, Profile], fake: dict[int, Profile]) -> BatchTimes:
        sizes = sorted(real)[:2]
        return cls(tuple((b, real[b]) for b in sizes), tuple((b, fake[b]) for b in sizes))

    @property
    def method(self) -> str:
        """How times at other sizes are made (for the result's notes)."""
        if not self.real:
            return "estimated from FLOPs and bytes (no micro-batch fit plainly to be timed)"
        if len(self.real) == 1:
            return f"real op times at micro-batch {self.real[0][0]}, scaled by the batch"
        (b1, _), (b2, _) = self.real
        return f"real op times at micro-batches {b1} and {b2}, linear in the batch per op"

    def at(self, fake: Profile, b: int) -> Profile:
        """``fake`` (the step at micro-batch ``b``) with real-derived times."""
        if not self.real:
            return fake
        (b1, r1) = self.real[0]
        if len(self.real) == 1:
            total = r1.step_time * b / b1
            return _summing_to(retimed(fake, lambda op: op.time), total)
        (b2, r2) = self.real[1]
        total = _linear(r1.step_time, r2.step_time, b1, b2, b)
        if _names(r1) == _names(r2) == _names(fake):

            def time_of(op) -> float:
                return _linear(r1.ops[op.index].time, r2.ops[op.index].time, b1, b2, b)

            return _summing_to(retimed(fake, time_of), total)
        return _summing_to(retimed(fake, lambda op: op.time), total)


def _linear(t1: float, t2: float, b1: int, b2: int, b: int) -> float:
    """``t1 + s * (b - b1)`` with ``s >= 0``; below ``b1`` at least ``t1 * b / b1`` (a
    negative step time below the timed sizes broke the planner's tie rule)."""
    t = t1 + max(0.0, (t2 - t1) / (b2 - b1)) * (b - b1)
    return max(t, t1 * b / b1) if b < b1 else t


def _summing_to(timed: Profile, total: float) -> Profile:
    """``timed`` with its op times scaled to sum to ``total`` seconds, its step time ``total``."""
    scale = total / max(timed.step_time, 1e-12)
    return replace(retimed(timed, lambda op: op.time * scale), step_time=total)
