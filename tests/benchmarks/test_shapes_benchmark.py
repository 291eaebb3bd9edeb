"""Smoke test: ``benchmarks/shapes.py --quick`` runs and writes its report, JSON and plot.

Like the other benchmark smoke tests it checks the script works, not its numbers
(except the ones the library guarantees: no step over the budget, plain gradients).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_shapes_quick_writes_report_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.shapes", "--quick", "--threads", "1",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    [md] = tmp_path.glob("shapes-cpu-*.md")
    data = json.loads(md.with_suffix(".json").read_text())
    assert md.with_suffix(".png").stat().st_size > 1000
    assert {r["model"] for r in data["results"]} == {"gpt2", "llama"}
    for r in data["results"]:
        assert r["violations"] == 0
        assert r["grads_equal_steps"] == len(r["steps"]) == len(r["lengths"])
    assert "every step within the budget" in md.read_text()
