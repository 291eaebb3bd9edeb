"""Smoke test: benchmarks/compiled.py --quick runs every kind of contender and writes its report.

It checks the script works (each contender measured in its own worker, table,
verdicts, plot); it never asserts on the measured numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compiled_quick_writes_report(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compiled", "--quick", "--threads", "1",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (md,) = tmp_path.glob("compiled-cpu-*.md")
    data = json.loads(md.with_suffix(".json").read_text())
    assert md.with_suffix(".png").stat().st_size > 0
    rows = data["results"]["gpt2"]
    kinds = {r["kind"] for r in rows.values()}
    assert kinds == {"eager", "compiler", "twin", "gradckpt", "knob", "bytes"}, rows
    for label, row in rows.items():
        assert "error" not in row, (label, row)
        assert row["peak"] > 0 and row["median_s"] > 0
    compiler_points = sum(r["kind"] == "compiler" for r in rows.values())
    assert len(data["verdicts"]["gpt2"]) == len(data["verdicts_all"]["gpt2"]) == compiler_points
    assert len(data["verdicts_held_out"]["gpt2"]) == compiler_points
    assert data["info"]["own_compile_caches"] is True  # every contender compiled from scratch
    text = md.read_text()
    assert "| contender | peak (MiB) | peak / eager |" in text
    assert "| compiler point | gradckpt point | paired time ratio (95% interval) | verdict |" in text
    assert "| twin | paired time ratio (95% interval) |" in text
    # The knob-matched rows record the compiler's bytes at their knob as their cap.
    matched = [r for label, r in rows.items() if "<=amb=" in label]
    assert matched and all(r["partitions"] for r in matched)
    assert "| contender | default saves (MiB) | cap (MiB) | saved (MiB) |" in text


def test_each_contender_starts_with_its_own_compile_cache(tmp_path: Path, monkeypatch) -> None:
    from benchmarks.compiled import _CACHE_VARIABLE, _compile_cache

    monkeypatch.setenv(_CACHE_VARIABLE, "/shared")
    with _compile_cache(tmp_path / "a"):
        assert os.environ[_CACHE_VARIABLE] == str(tmp_path / "a")
    assert os.environ[_CACHE_VARIABLE] == "/shared"
    with _compile_cache(None):  # --shared-cache
        assert os.environ[_CACHE_VARIABLE] == "/shared"
    monkeypatch.delenv(_CACHE_VARIABLE)
    with _compile_cache(tmp_path / "b"):
        pass
    assert _CACHE_VARIABLE not in os.environ


def test_compiled_quick_with_two_processes_per_contender(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compiled", "--quick", "--threads", "1",
         "--kinds", "compiler", "--budgets", "1", "--processes", "2",
         "--name", "pooled", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (md,) = tmp_path.glob("pooled-cpu-*.md")
    data = json.loads(md.with_suffix(".json").read_text())
    assert data["info"]["processes"] == 2
    rows = data["results"]["gpt2"]
    assert set(rows) == {"eager", "compile amb=1"}
    for row in rows.values():
        assert len(row["replica_times"]) == 2 and len(row["replica_peaks"]) == 2
        assert row["times"] == [
            (a + b) / 2 for a, b in zip(*row["replica_times"])
        ]  # the median of two processes' steps, round by round
    text = md.read_text()
    assert "| contender | median step per process (s) | slowest / fastest |" in text
    assert "ran in 2 processes" in text


class _FakeWorker:
    """A worker's pipe end: answers each step with a time, or dies after ``lives`` steps."""

    def __init__(self, seconds: float, lives: int | None = None) -> None:
        self.seconds, self.lives, self.steps = seconds, lives, 0

    def send(self, message: str) -> None:
        if self.lives is not None and self.steps >= self.lives:
            raise BrokenPipeError("worker gone")
        self.steps += 1

    def recv(self) -> float:
        return self.seconds


def test_a_worker_that_dies_keeps_its_rounds_and_the_others_go_on(monkeypatch) -> None:
    import benchmarks.compiled as compiled

    monkeypatch.setattr(compiled, "GAP_S", 0.0)
    conns = {"steady": _FakeWorker(1.0), "dies": _FakeWorker(2.0, lives=3)}
    times = compiled.timed_rounds(conns, warmup=1, repeats=4, seed=0)
    assert times == {"steady": [1.0] * 4, "dies": [2.0, 2.0]}  # 3 steps, the first a warm-up


def test_no_worker_starts_when_memory_is_short(monkeypatch) -> None:
    import benchmarks.compiled as compiled

    monkeypatch.setattr(compiled, "available_mib", lambda: compiled.MIN_AVAILABLE_MIB - 1)

    def never(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(compiled, "start_worker", never)
    started, error = compiled._start_replicas(None, "gpt2", {}, {}, 1, [None, None])
    assert started == [] and error.startswith("not started:") and "MiB of memory" in error
