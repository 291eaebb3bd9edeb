"""time_fn / time_interleaved: structure only (runs, order, warm-up, sync); never wall time."""

from __future__ import annotations

import dataclasses

import pytest

from gradckpt.measure import Timing, ratio, time_fn, time_interleaved
from gradckpt.measure import timing as timing_module


class FakeClock:
    """Stands in for time.perf_counter; the timed functions advance it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing_module.time, "perf_counter", fake)
    return fake


def test_time_fn_runs_warmup_plus_repeats_and_measures_only_the_repeats(clock):
    durations = iter([100.0, 100.0, 3.0, 1.0, 2.0])  # two warm-up runs, then three measured

    def fn():
        clock.now += next(durations)

    t = time_fn(fn, warmup=2, repeats=3, sync=False)
    assert t.times == (3.0, 1.0, 2.0)
    assert (t.median, t.mean, t.stdev) == (2.0, 2.0, 1.0)
    assert clock.reads == 6  # two per measured run, none for warm-up
    with pytest.raises(StopIteration):
        next(durations)


def test_sync_waits_before_each_clock_read(clock):
    events = []
    time_fn(lambda: events.append("run"), warmup=1, repeats=2, sync=lambda: events.append("sync"))
    assert events == ["run", "sync", "run", "sync", "sync", "run", "sync"]


def test_time_interleaved_runs_round_robin(clock):
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    result = time_interleaved(fns, warmup=2, repeats=3, sync=False)
    assert calls == ["a", "b", "c"] * 5
    assert list(result) == ["a", "b", "c"]
    assert all(len(t.times) == 3 for t in result.values())


def test_time_interleaved_attributes_each_run_to_its_contender(clock):
    cost = {"slow": 4.0, "fast": 1.0}

    def make(name):
        def fn():
            clock.now += cost[name]

        return fn

    result = time_interleaved({n: make(n) for n in cost}, warmup=1, repeats=4, sync=False)
    assert result["slow"].times == (4.0,) * 4
    assert result["fast"].times == (1.0,) * 4
    assert ratio(result["slow"], result["fast"]) == 4.0


def test_real_clock_structure_only():
    calls = []
    t = time_fn(lambda: calls.append(1), warmup=3, repeats=4)
    assert len(calls) == 7 and len(t.times) == 4
    assert all(x >= 0 for x in t.times)


def test_cpu_devices_need_no_sync():
    assert timing_module._synchronizer(False) is None
    assert timing_module._synchronizer("cpu") is None
    assert timing_module._synchronizer("meta") is None


def test_timing_statistics_and_ratio():
    t = Timing.from_times([4, 1, 3, 2])
    assert t.times == (4.0, 1.0, 3.0, 2.0)
    assert (t.median, t.mean) == (2.5, 2.5)
    assert t.stdev == pytest.approx(1.2909944487358056)
    assert Timing.from_times([5.0]).stdev == 0.0
    assert ratio(Timing.from_times([3.0]), Timing.from_times([2.0])) == 1.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.median = 1.0
    with pytest.raises(ValueError):
        ratio(t, Timing.from_times([0.0]))
    with pytest.raises(ValueError):
        Timing.from_times([])


@pytest.mark.parametrize("kwargs", [{"repeats": 0}, {"warmup": -1}, {"repeats": 1.5}])
def test_bad_counts_are_rejected(kwargs):
    with pytest.raises(ValueError):
        time_fn(lambda: None, **kwargs)
    with pytest.raises(ValueError):
        time_interleaved({"a": lambda: None}, **kwargs)


def test_time_interleaved_needs_a_contender():
    with pytest.raises(ValueError):
        time_interleaved({})
