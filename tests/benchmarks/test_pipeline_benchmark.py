"""Smoke test: ``benchmarks/pipeline.py --quick`` runs 2 gloo ranks and writes its tables
(timings not asserted; the per-rank peaks are, against the budget the report states)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_pipeline_quick_writes_its_report_and_rerenders_it(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.pipelining")
    command = [sys.executable, "-m", "benchmarks.pipeline", "--quick", "--threads", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (md,) = tmp_path.glob("pipeline-cpu-*.md")
    text = md.read_text()
    for label in ("per-stage", "uniform every_block", "plain"):
        assert f"| {label} |" in text, label
    data = json.loads(md.with_suffix(".json").read_text())
    budget = data["ranks"][0]["budget"]
    for rank in data["ranks"]:
        assert rank["peaks"]["per-stage"] <= budget  # each rank's allocator high-water
    assert max(r["peaks"]["plain"] for r in data["ranks"]) > budget  # the budget binds
    again = tmp_path / "again"
    rerun = subprocess.run([*command, "--from-json", str(md.with_suffix(".json")), "--out",
                            str(again)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env=env)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert next(again.glob("pipeline-cpu-*.md")).read_text() == text
