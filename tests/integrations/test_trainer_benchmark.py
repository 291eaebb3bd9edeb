"""Smoke test: the LoRA and U-Net models of ``benchmarks/hf_models.py --quick`` run and report.

Checks the script and the report's shape and the exact facts (budgets held,
gradients equal); never the times (those belong in ``benchmarks/results/``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[2]


def test_quick_lora_and_unet_run_writes_the_report(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hf_models", "--quick", "--threads", "1",
         "--models", "llama-lora", "sd-unet", "--tag", "lora-unet", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=720,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (md,) = tmp_path.glob("lora-unet-cpu-*.md")
    data = json.loads(md.with_suffix(".json").read_text())
    assert set(data["models"]) == {"llama-lora", "sd-unet"}
    assert "peft" in data["info"] and "diffusers" in data["info"]
    for model in data["models"].values():
        runs = model["runs"]
        assert runs["plain"]["peak_bytes"] > runs["hf"]["peak_bytes"] > 0  # the switch works
        for name in ("gradckpt@hf", "gradckpt@half"):
            assert runs[name]["within_budget"] is True
            assert runs[name]["grad_max_abs_diff"] == 0.0
