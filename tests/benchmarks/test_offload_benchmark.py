"""``benchmarks/offload.py`` (quick) and the GPU check's offload contenders in a CPU dry run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.offload_gpu import report_lines, run_offload_contenders

ROOT = Path(__file__).resolve().parents[2]


def test_offload_quick_writes_a_report_that_says_timing_is_simulated(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.offload", "--quick", "--threads", "1",
         "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (md,) = tmp_path.glob("offload-cpu-*.md")
    text = md.read_text()
    assert "**Timing is simulated on CPU.**" in text
    data = json.loads(md.with_suffix(".json").read_text())
    gpt = data["models"]["gpt"]
    assert set(gpt["curves"]) == {"cpu", "accelerator"}
    for curves in gpt["curves"].values():
        for link in ("25 GB/s", "400 GB/s"):
            assert curves[link]["at_or_below_everywhere"]
    for row in gpt["measured"]:
        # Bit for bit, or a plan that chunks (another order of sums) within 1e-5.
        assert row["gradients_bit_equal"] or (row["chunked"] and row["gradients_within_1e-5"])
        assert row["measured_host_bytes"] == row["predicted_host_bytes"]


def test_offload_contenders_dry_run_on_cpu():
    result = run_offload_contenders(dry=True, device="cpu", log=lambda s: None)
    rows = result["rows"]
    assert {"plain", "full_ckpt", "offload_all+full_ckpt"} <= set(rows)
    for name, row in rows.items():
        assert row["max_grad_diff"] == 0.0, name  # same seed, dropout on: bit-equal
        assert row["peak_bytes"] > 0
    assert rows["full_ckpt"]["peak_bytes"] < rows["plain"]["peak_bytes"]
    floor = rows["gradckpt_offload_floor"]  # the CUDA backend's row, here on the host copy
    assert floor["within_budget"] and floor["budget_bytes"] <= floor["floor_without_bytes"]
    assert floor["host_bytes"] == floor["predicted_host_bytes"]
    assert "| contender | peak (MiB)" in "\n".join(report_lines(result))


def test_offload_floor_quick_runs_each_floor_plan_exactly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.offload_floor", "--quick", "--threads", "1",
         "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (md,) = tmp_path.glob("offload-floor-cpu-*.md")
    assert "**Overheads are simulated**" in md.read_text()
    data = json.loads(md.with_suffix(".json").read_text())
    for name, model in data["models"].items():
        for key in ("segments", "no_segments"):
            row = model[key]
            assert row["floor_with"] <= row["floor_without"], (name, key)
            run = row["floor_plan_run"]
            assert run["gradients_bit_equal"], (name, key)
            # At the allocator, within the prediction; on HF GPT-2 a few bytes over it
            # (scalar tensors made outside any op: docs/limitations.md, "a budget set
            # exactly at a predicted peak can be missed by a few bytes"; 72 bytes on the
            # 4-layer narrow GPT-2 with streamed offload, when it was written).
            slack = 0 if model["family"] == "zoo" else max(256, 1e-5 * run["predicted_peak_bytes"])
            assert run["measured_peak_bytes"] <= run["predicted_peak_bytes"] + slack, (name, key)
            assert run["measured_host_bytes"] == run["predicted_host_bytes"], (name, key)
        assert model["no_segments"]["floor_with"] < model["no_segments"]["floor_without"], name
