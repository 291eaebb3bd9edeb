"""Smoke test: ``benchmarks/chunk.py --quick`` runs and writes its tables (numbers not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chunk_quick_writes_its_report_and_rerenders_it(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.chunk", "--quick", "--threads", "1"]
    proc = subprocess.run(
        [*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (md,) = tmp_path.glob("chunk-cpu-*.md")
    text = md.read_text()
    assert "| contender | budget | plan | predicted peak | measured peak | fits | overhead |" in text
    for label in ("plain", "recompute @ floor", "offload @ 0.85x floor", "chunk @ 0.85x floor",
                  "hand chunked CE", "gradckpt at hand chunked CE's peak"):  # fmt: skip
        assert f"| {label} |" in text, label
    data = json.loads(md.with_suffix(".json").read_text())
    (model,) = data["results"]
    assert set(model["least"]) == {"recompute", "offload", "chunk"}
    again = tmp_path / "again"
    rerun = subprocess.run(
        [*command, "--from-json", str(md.with_suffix(".json")), "--out", str(again)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert next(again.glob("chunk-cpu-*.md")).read_text() == text
