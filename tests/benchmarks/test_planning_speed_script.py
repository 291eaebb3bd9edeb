"""Smoke test: the planning-speed benchmark runs in --quick mode and writes its report.

It checks the script works and writes the table; it never asserts on the
measured seconds (those belong in the results file).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_planning_speed_quick_writes_report(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.planning_speed", "--quick", "--threads", "1",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    md = sorted(tmp_path.glob("planning-speed-cpu-*.md"))
    assert len(md) == 1, md
    text = md[0].read_text()
    assert "| model | blocks | chain (s) | dp (s) | finish (s) | total (s) |" in text
    rows = json.loads(md[0].with_suffix(".json").read_text())["rows"]
    assert [(r["model"], r["blocks"]) for r in rows] == [
        ("mlp", 4),
        ("mlp", 8),
        ("gpt", 4),
        ("gpt", 8),
    ]
    for row in rows:
        assert set(row["wall"]) == {"chain", "dp", "finish"}
        assert row["predicted_peak_bytes"] <= row["budget_bytes"]  # the plan fits its budget
        # Identical blocks share nested cells: a few per depth, not depth squared.
        assert row["distinct_nested_cells"] < row["stages"] ** 2 / 2
    assert "chain" in proc.stdout and "blocks" in proc.stdout  # the table is printed too
