"""Smoke test: ``benchmarks/mlp_chunk.py --quick`` runs, writes its tables and re-renders them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mlp_chunk_quick_writes_its_report_and_rerenders_it(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.mlp_chunk", "--quick", "--threads", "1"]
    proc = subprocess.run(
        [*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (md,) = tmp_path.glob("mlp-chunk-cpu-*.md")
    text = md.read_text()
    for label in ("plain", "head chunking: least peak", "head + MLP chunking: least peak"):
        assert f"| {label} |" in text, label
    (model,) = json.loads(md.with_suffix(".json").read_text())["results"]
    assert model["rows"]["head + MLP chunking: least peak"]["token_chunks"]
    again = tmp_path / "again"
    rerun = subprocess.run(
        [*command, "--from-json", str(md.with_suffix(".json")), "--out", str(again)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert next(again.glob("mlp-chunk-cpu-*.md")).read_text() == text
