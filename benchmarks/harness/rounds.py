"""Contenders measured side by side: a peak each (untimed), then interleaved timed rounds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.harness.contenders import Installer, Undo
from benchmarks.harness.results import MiB
from benchmarks.harness.stats import fastest_ratio
from benchmarks.harness.steps import clear_grads, make_step, measure_peaks
from gradckpt.measure import Timing, ratio, time_interleaved
from gradckpt.testing import Example


@dataclass
class Measured:
    """One contender's measured peak and step times."""

    name: str
    peak_bytes: int  # the allocator's (budgets are checked against it)
    loss: float
    tracker_peak_bytes: int | None = None  # the tensors' (MemoryTracker)
    timing: Timing | None = None
    ratio: float | None = None  # median step time over the baseline's
    min_ratio: float | None = None  # fastest run over the baseline's fastest (least disturbed)
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "peak_bytes": self.peak_bytes,
            "peak_mib": self.peak_bytes / MiB,
            "tracker_peak_bytes": self.tracker_peak_bytes,
            "loss": self.loss,
            "median_s": self.timing.median if self.timing else None,
            "times_s": list(self.timing.times) if self.timing else None,
            "ratio": self.ratio,
            "min_ratio": self.min_ratio,
            **self.info,
        }


def measured_from_json(rows: dict[str, dict[str, Any]], baseline: str) -> dict[str, Measured]:
    """Rebuild :class:`Measured` results (ratios recomputed) from ``Measured.to_json`` rows."""
    out = {}
    for name, row in rows.items():
        times = row.get("times_s")
        m = Measured(name, row["peak_bytes"], row["loss"], row.get("tracker_peak_bytes"))
        if times:
            m.timing = Timing.from_times(times)
        out[name] = m
    base = out[baseline].timing
    for m in out.values():
        if m.timing is not None and base is not None:
            m.ratio = ratio(m.timing, base)
            m.min_ratio = fastest_ratio(m.timing, base)
    return out


def measure_contenders(
    build: Callable[[], Example],
    contenders: dict[str, Installer],
    *,
    baseline: str,
    warmup: int,
    repeats: int,
    seed: int = 0,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] | None = None,
    sync: Callable[[], None] | None = None,
) -> dict[str, Measured]:
    """Measure every contender's peak (untimed step), then time them all interleaved.

    Each contender gets its own model from ``build()`` (same seed, same weights),
    installed once before timing and removed after. ``clock`` and ``sync`` go to
    :func:`~gradckpt.measure.time_interleaved` (default: wall time, no sync).
    """
    if baseline not in contenders:
        raise ValueError(f"the baseline {baseline!r} is not among the contenders")
    examples: dict[str, Example] = {}
    undos: list[Undo] = []
    try:
        results: dict[str, Measured] = {}
        steps: dict[str, Callable[[], torch.Tensor]] = {}
        for name, install in contenders.items():
            example = build()
            examples[name] = example
            peak, tracker_peak, loss = measure_peaks(example, install, seed)
            results[name] = Measured(name, peak, loss, tracker_peak)
            undos.append(install(example))
            steps[name] = make_step(example, seed)
            log(f"  peak {name:<28} {peak / MiB:10.1f} MiB (tensors {tracker_peak / MiB:.1f})"
                f"  loss {loss:.6f}")  # fmt: skip
        log(f"  timing {len(steps)} contenders interleaved: {warmup} warm-up, {repeats} rounds")
        timings = time_interleaved(steps, warmup=warmup, repeats=repeats, clock=clock, sync=sync)
        for name, timing in timings.items():
            results[name].timing = timing
            results[name].ratio = ratio(timing, timings[baseline])
            results[name].min_ratio = fastest_ratio(timing, timings[baseline])
        return results
    finally:
        for undo in reversed(undos):
            undo()
        for example in examples.values():
            clear_grads(example.model)
