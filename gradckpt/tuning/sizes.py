"""The micro-batch sizes ``tune`` considers, and its bounded inputs, checked before any work.

``tune`` profiles every candidate size under fake tensors and runs the best
few, so its work grows with the candidates: each argument that sets them is
bounded here, with a one-line error that says what to pass instead.

* ``global_batch``: a whole number from 1 to :data:`MOST_SAMPLES`; its divisors
  up to :data:`LARGEST_MICRO_BATCH` are the candidates (found in at most that
  many steps, whatever the number). One with no divisor there but 1 (a prime
  above it) leaves nothing to choose: refused, with the nearest global batches
  that have one.
* ``batch_sizes``: whole numbers from 1 to :data:`LARGEST_MICRO_BATCH`.
* ``top`` and ``rounds``: whole numbers >= 1 (0 would measure nothing).

Example:
    >>> candidate_sizes(12, None)
    [1, 2, 3, 4, 6, 12]
    >>> check_counts(top=0, rounds=3)
    Traceback (most recent call last):
    ValueError: top is how many gradckpt candidates run for real, a whole number >= 1; got 0
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["LARGEST_MICRO_BATCH", "MOST_SAMPLES", "candidate_sizes", "check_counts"]

#: The largest micro-batch tune profiles (also where the powers of two stop without a
#: global batch): beyond it a fake profile's sizes, not memory, are what grows.
LARGEST_MICRO_BATCH = 1 << 12

#: The most samples per optimizer step tune takes: 16x the largest global batches
#: published for ImageNet (64k with LARS); a larger number is most likely tokens, or a typo.
MOST_SAMPLES = 1 << 20


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_counts(*, top: object, rounds: object) -> None:
    """Refuse a ``top`` or ``rounds`` that is not a whole number >= 1 (ValueError).

    Example:
        >>> check_counts(top=2, rounds=3)
    """
    for name, value, what in (
        ("top", top, "how many gradckpt candidates run for real"),
        ("rounds", rounds, "real runs per measured candidate"),
    ):
        if not _whole(value) or value < 1:  # type: ignore[operator]
            raise ValueError(f"{name} is {what}, a whole number >= 1; got {value!r}")


def candidate_sizes(
    global_batch: int | None, batch_sizes: Sequence[int] | None
) -> list[int] | None:
    """The micro-batch sizes to profile, ascending (None: powers of two, found while profiling).

    Raises ValueError naming the bound when an argument is out of range.

    Example:
        >>> candidate_sizes(8, [2, 4])
        [2, 4]
    """
    if global_batch is not None:
        _check_global(global_batch)
    if batch_sizes is not None:
        sizes = sorted(set(batch_sizes))
        if not sizes or any(not _whole(b) or not 1 <= b <= LARGEST_MICRO_BATCH for b in sizes):
            raise ValueError(
                f"batch_sizes are micro-batch sizes from 1 to {LARGEST_MICRO_BATCH}, "
                f"got {list(batch_sizes)}"
            )
        bad = [b for b in sizes if global_batch is not None and global_batch % b]
        if bad:
            raise ValueError(f"batch_sizes {bad} do not divide global_batch={global_batch}")
        return sizes
    if global_batch is None:
        return None
    sizes = _divisors(global_batch)
    if global_batch > 1 and sizes == [1]:
        below, above = _nearest_with_divisor(global_batch)
        raise ValueError(
            f"global_batch={global_batch} has no divisor from 2 to {LARGEST_MICRO_BATCH} (the "
            f"largest micro-batch tune tries), so micro-batch 1 is its only candidate: use a "
            f"global batch such as {below} or {above}, or batch_sizes=[1] to time that alone"
        )
    return sizes


def _check_global(global_batch: object) -> None:
    if not _whole(global_batch) or not 1 <= global_batch <= MOST_SAMPLES:  # type: ignore[operator]
        raise ValueError(
            f"global_batch is the samples per optimizer step, a whole number from 1 to "
            f"{MOST_SAMPLES}; got {global_batch!r}"
        )


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` up to :data:`LARGEST_MICRO_BATCH` (and ``n`` itself when below it)."""
    return [b for b in range(1, min(n, LARGEST_MICRO_BATCH) + 1) if n % b == 0]


def _nearest_with_divisor(n: int) -> tuple[int, int]:
    below = next(m for m in range(n - 1, 0, -1) if len(_divisors(m)) > 1)
    above = next(m for m in range(n + 1, 2 * n + 1) if len(_divisors(m)) > 1)
    return below, above
