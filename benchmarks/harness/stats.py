"""Statistics of timed rounds: ratios, spreads and bootstrap intervals.

A contender's row holds ``times`` (one per timed round; the i-th entries of two
rows come from the same interleaved round) and, when it ran in several
processes, ``replica_times`` (one list per process). Ratios are *paired*: taken
round by round, so what drifts between rounds (load, frequency) cancels.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from gradckpt.measure import Timing

BOOTSTRAP = 2000  # resamples behind every interval


def fastest_ratio(timing: Timing, base: Timing) -> float:
    """The fastest round over the baseline's fastest (the least disturbed runs)."""
    return min(timing.times) / min(base.times)


def median_spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """``median [least-greatest]`` of ``values``, each written with ``fmt``; ``n/a`` if none."""
    if not values:
        return "n/a"
    med = statistics.median(values)
    return f"{fmt.format(med)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def paired_ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> list[float]:
    """Per timed round, our step time over theirs (rounds where both were timed)."""
    return [a / b for a, b in zip(ours["times"], theirs["times"]) if b > 0]


def pooled(replica_times: list[list[float]]) -> list[float]:
    """Per round, the median of the processes' step times (processes of one contender).

    A process that died has fewer rounds; later rounds pool the processes still timed.
    """
    rounds = max((len(t) for t in replica_times), default=0)
    return [statistics.median(t[i] for t in replica_times if len(t) > i) for i in range(rounds)]


def _replicas(row: dict[str, Any]) -> list[list[float]]:
    return row.get("replica_times") or [row["times"]]


def paired_stats(
    ours: dict[str, Any], theirs: dict[str, Any], rounds: slice = slice(None), seed: int = 0
) -> tuple[float, float, float]:
    """Median paired ratio over ``rounds`` and a bootstrap 95% interval.

    With one process per side the bootstrap resamples rounds; with several it
    also resamples each side's processes (then pools them per round), so the
    interval holds the noise that stays with a process, not only the round's.
    """
    ratios = paired_ratios(ours, theirs)[rounds]
    mine, other = _replicas(ours), _replicas(theirs)
    if len(mine) == 1 and len(other) == 1:
        return median_interval(ratios, seed)
    mine = [t[rounds] for t in mine]
    other = [t[rounds] for t in other]
    rng = random.Random(seed)
    medians = []
    for _ in range(BOOTSTRAP):
        a = pooled(rng.choices(mine, k=len(mine)))
        b = pooled(rng.choices(other, k=len(other)))
        n = min(len(a), len(b))
        picks = rng.choices(range(n), k=n)
        medians.append(statistics.median(a[i] / b[i] for i in picks))
    medians.sort()
    return (
        statistics.median(ratios),
        medians[int(0.025 * BOOTSTRAP)],
        medians[int(0.975 * BOOTSTRAP) - 1],
    )


def median_interval(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """The median and a bootstrap 95% interval of the median (seeded, so reports reproduce)."""
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP)
    )
    return (
        statistics.median(values),
        medians[int(0.025 * BOOTSTRAP)],
        medians[int(0.975 * BOOTSTRAP) - 1],
    )
