"""Smoke test: ``benchmarks/tune.py --quick`` runs and writes its report, JSON and plot.

Like the other benchmark smoke tests it checks that the script works, and only
the numbers the library guarantees: tune's whole-step peak within the budget.
Which contender is fastest, and how near tune's prediction comes, belong in
the results files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_tune_quick_writes_report_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from benchmarks.tune import MODELS
    from benchmarks.tune_report import VERDICT_HEADERS

    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.tune", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    [md] = tmp_path.glob("tune-cpu-*.md")
    assert md.with_suffix(".png").is_file() and md.with_suffix(".png").stat().st_size > 0
    data = json.loads(md.with_suffix(".json").read_text())
    text = md.read_text()
    assert "| " + " | ".join(VERDICT_HEADERS) + " |" in text
    rows = [(m["model"], r["budget"]) for m in data["models"] for r in m["rows"]]
    assert rows == [(m, b) for m in MODELS for b in ("loose", "tight")]  # one per (model, budget)
    for model in data["models"]:
        for row in model["rows"]:
            budget = row["budget_bytes"]
            assert f"| {model['model']} | {row['budget']} ({budget / 2**20:.1f}) |" in text
            tune = row["contenders"]["d"]
            assert "error" not in tune, tune.get("error")
            assert tune["peak_bytes"] <= budget, (model["model"], row["budget"])
            assert tune["micro_batch"] * tune["accumulation"] == data["info"]["global_batch"]
            assert len(tune["times"]) == 2  # quick: two timed rounds
            assert tune["planning_seconds"] >= 0 and tune["measuring_seconds"] >= 0
            # (a) is the largest plain micro-batch within the budget, found by halving
            search = row["searches"]["a"]
            assert [t["fits"] for t in search["trials"]][-1] is True
            assert search["oom_trials"] == len(search["trials"]) - 1
        assert set(model["per_sample"]) == {"1", "2", "4", "8"}
    assert data["info"]["quick"] is True and data["info"]["repeats"] == 2
    assert "## Per-sample time against micro-batch size" in text
    # --from-json re-renders the same report without measuring
    again = tmp_path / "again"
    rerun = subprocess.run(
        [sys.executable, "-m", "benchmarks.tune", "--from-json", str(md.with_suffix(".json")),
         "--out", str(again)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (again / md.name).read_text() == text
