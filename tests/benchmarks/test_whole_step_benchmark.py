"""Smoke test: ``benchmarks/whole_step.py --quick`` runs and writes its report and JSON.

Like the other benchmark smoke tests it checks the script works, and only the
numbers the library guarantees: the optimizer state predicted to the byte, and
the planned run's whole-step peak within its budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_whole_step_quick_writes_report_and_json(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from benchmarks.whole_step import SETUPS

    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.whole_step", "--quick", "--threads", "1",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    [md] = tmp_path.glob("whole-step-cpu-*.md")
    data = json.loads(md.with_suffix(".json").read_text())
    text = md.read_text()
    assert "| optimizer | state pred / meas (MiB) | state exact |" in text
    assert [r["optimizer"] for r in data["rows"]] == [s.label for s in SETUPS]
    for setup in SETUPS:
        assert f"| {setup.label} |" in text  # a table row per optimizer
    for r in data["rows"]:
        assert r["state_predicted_bytes"] == r["state_measured_bytes"], r["optimizer"]
        assert r["planned_measured_bytes"] is not None, r.get("fit_error")
        assert r["planned_measured_bytes"] <= r["budget_bytes"], r["optimizer"]
        assert r["formula_bytes"] < r["plain_measured_bytes"]  # formulas know no activations
    assert [r["accumulation_steps"] for r in data["rows"]].count(4) == 1
    info = data["info"]
    assert info["quick"] is True and "torch" in info and "cpu" in info and "date" in info
    assert info["command"].startswith("python -m benchmarks.whole_step --quick")
    assert f"Rerun: `{info['command']}`" in text
    assert "wrote" in proc.stdout
