"""Wall-clock timing with warm-up, medians and device synchronization.

Benchmarks compare contenders by the ratio of their medians measured side by
side (:func:`time_interleaved`), which cancels most of the drift of a shared
machine; tests never assert on these numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Timing", "low_estimate", "ratio", "time_fn", "time_interleaved", "work_clock"]

Sync = bool | str | torch.device | Callable[[], None] | None


@dataclass(frozen=True)
class Timing:
    """Seconds per run of one contender: the runs in order and their statistics.

    Example:
        >>> Timing.from_times([0.3, 0.1, 0.2]).median
        0.2
    """

    median: float
    times: tuple[float, ...]
    mean: float
    stdev: float

    @classmethod
    def from_times(cls, times: Any) -> Timing:
        """Summarize measured run times (seconds); needs at least one."""
        times = tuple(float(t) for t in times)
        if not times:
            raise ValueError("Timing needs at least one measured run")
        stdev = statistics.stdev(times) if len(times) > 1 else 0.0
        return cls(statistics.median(times), times, statistics.fmean(times), stdev)

    def __str__(self) -> str:
        return f"{self.median * 1e3:.3f} ms (median of {len(self.times)}, ±{self.stdev * 1e3:.3f})"


def ratio(a: Timing, b: Timing) -> float:
    """``a.median / b.median``: e.g. checkpointed step time over plain step time.

    Example:
        >>> ratio(Timing.from_times([2.0]), Timing.from_times([1.0]))
        2.0
    """
    if b.median <= 0:
        raise ValueError(f"cannot divide by a median time of {b.median} s")
    return a.median / b.median


def work_clock(device: str | torch.device = "cpu") -> Callable[[], float]:
    """The clock to time work on ``device`` with: seconds, only differences matter.

    On the CPU it is this thread's CPU time (``time.thread_time``): on a shared
    machine, wall time also counts the slices the scheduler gave to other
    processes, which made one op look 4x slower in one profile than in the next;
    CPU time counts only the work (the autograd engine runs CPU backward on the
    calling thread too). Elsewhere the host does not do the work: wall time.

    Example:
        >>> clock = work_clock("cpu"); start = clock(); step(); seconds = clock() - start
    """
    kind = torch.device(device).type if not isinstance(device, torch.device) else device.type
    return time.thread_time if kind == "cpu" else time.perf_counter


def low_estimate(times: Any) -> float:
    """The time a run takes when nothing disturbs it: the least of the measured runs.

    Noise on a shared machine (a cold first run, another process on the core,
    cache evictions) only ever adds time, so the minimum is the most repeatable
    statistic of a few runs; a median of three still moves with one bad run.

    Example:
        >>> low_estimate([0.31, 0.30, 0.45])
        0.3
    """
    values = [float(t) for t in times]
    if not values:
        raise ValueError("low_estimate needs at least one measured time")
    return min(values)


def _synchronizer(sync: Sync) -> Callable[[], None] | None:
    # Never touch torch.cuda where it is not available: a CPU build has nothing
    # to wait for, and asking may initialize or warn.
    if callable(sync):
        return sync
    if sync is False:
        return None
    if sync is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.synchronize
        return None
    if sync is True:
        return torch.cuda.synchronize if torch.cuda.is_available() else None
    device = torch.device(sync)
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    if module is None or not callable(available) or not available():
        return None
    return lambda: module.synchronize(device)


def _check(warmup: int, repeats: int) -> None:
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")


def _run_once(
    fn: Callable[[], Any], wait: Callable[[], None] | None, clock: Callable[[], float] | None = None
) -> float:
    # Queued device work must finish before either clock read, or it is billed
    # to the wrong run.
    clock = clock or time.perf_counter
    if wait is not None:
        wait()
    start = clock()
    fn()
    if wait is not None:
        wait()
    return clock() - start


def time_fn(
    fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5, sync: Sync = None
) -> Timing:
    """Time ``fn()``: ``warmup`` unmeasured runs, then ``repeats`` measured ones.

    Args:
        fn: a zero-argument callable (e.g. one training step).
        warmup: runs not measured (allocator warm-up, lazy init, autotuning).
        repeats: measured runs.
        sync: how to wait for the device before each clock read. None: CUDA if it
            is available and initialized; True: CUDA if available; False: never;
            a device (``"cuda:1"``) or a zero-argument callable.

    Example:
        >>> t = time_fn(lambda: model(x).sum().backward(), warmup=2, repeats=7)
        >>> t.median
    """
    _check(warmup, repeats)
    wait = _synchronizer(sync)
    for _ in range(warmup):
        fn()
    return Timing.from_times(_run_once(fn, wait) for _ in range(repeats))


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    *,
    warmup: int = 1,
    repeats: int = 5,
    sync: Sync = None,
    clock: Callable[[], float] | None = None,
) -> dict[str, Timing]:
    """Time several contenders round-robin (A B C A B C ...) in this process.

    Running them in turns exposes all of them to the same machine state (clock
    boost, other load), so the ratio of their medians is stable even when the
    absolute times drift. ``warmup`` unmeasured rounds come first. ``clock``:
    wall time by default; :func:`work_clock` for CPU time on a loaded machine.

    Example:
        >>> t = time_interleaved({"plain": step_plain, "ckpt": step_ckpt}, repeats=7)
        >>> ratio(t["ckpt"], t["plain"])
    """
    _check(warmup, repeats)
    if not fns:
        raise ValueError("time_interleaved needs at least one function to time")
    wait = _synchronizer(sync)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_run_once(fn, wait, clock))
    return {name: Timing.from_times(ts) for name, ts in times.items()}
