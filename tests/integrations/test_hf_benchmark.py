"""Smoke test: ``benchmarks/hf_models.py --quick`` runs and writes its report.

It checks the script and the report's shape, never the measured numbers (those
belong in ``benchmarks/results/``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradckpt.measure.beside import malloc_in_use

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_writes_the_report(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hf_models", "--quick", "--threads", "1",
         "--models", "gpt2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (md,) = tmp_path.glob("hf-cpu-*.md")
    text = md.read_text()
    data = json.loads(md.with_suffix(".json").read_text())
    assert "| model | target | wanted | measured | verdict |" in text
    for name in ("plain", "hf", "gradckpt@hf", "gradckpt@half"):
        assert f"`{name}`" in text
    assert set(data["models"]) == {"gpt2"}
    for model in data["models"].values():
        runs = model["runs"]
        assert runs["plain"]["peak_bytes"] > runs["hf"]["peak_bytes"] > 0
        # The budget is transformers' step at the level a byte budget is held on the CPU.
        hf = runs["hf"]
        assert runs["gradckpt@hf"]["budget_bytes"] == hf["peak_bytes"] + hf["beside_bytes"]
        if malloc_in_use() is not None:  # glibc: autograd's graph is malloc's
            assert hf["beside_bytes"] > 0
        assert runs["gradckpt@half"]["grad_max_abs_diff"] <= 1e-5
        # The plans themselves are kept (token chunks included), so a result can be read back.
        import gradckpt

        plan = gradckpt.Plan.from_json(runs["gradckpt@hf"]["plan"])
        assert plan.items and runs["plain"]["plan"] is None
        for path, k in plan.token_chunks:
            assert f"`{path}` x{k}" in text
    assert data["info"]["quick"] is True and "transformers" in data["info"]
