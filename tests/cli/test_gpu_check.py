"""``benchmarks/gpu_check.py``: one line and exit 0 without CUDA; ``--cpu-dry-run`` runs the same
code on CPU (the CPU allocator's peak for the CUDA counters) and writes the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from .conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_without_cuda_it_exits_with_one_line():
    proc = _run()
    assert proc.returncode == 0
    assert len(proc.stdout.splitlines()) == 1 and "no CUDA" in proc.stdout
    assert proc.stderr == ""


def test_cpu_dry_run_writes_the_report(tmp_path):
    proc = _run("--cpu-dry-run", "--skip-benchmarks", "--models", "zoo-gpt", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (md,) = tmp_path.glob("gpu-check-cpu-dry-run-*.md")
    text = md.read_text()
    assert "| model | budget | budget (MiB) | plan | predicted (MiB) | measured (MiB)" in text
    assert "reserved (MiB)" in text and "prediction error: median" in text
    data = json.loads(md.with_suffix(".json").read_text())
    (check,) = data["checks"]
    labels = [r["budget_label"] for r in check["rows"]]
    assert labels[:2] == ["plain", "least"]
    assert check["peak_level"] == "allocator"
    for row in check["rows"]:
        assert row["ok"], row
        # The dry run reads the CPU allocator: it sees every tensor and more; no reserved.
        assert row["measured_bytes"] >= row["tracker_bytes"] and row["reserved_bytes"] is None
        assert row["budget_bytes"] is None or row["measured_bytes"] <= row["budget_bytes"]


def test_benchmark_table_names_functions_that_exist():
    # The GPU run is the only one that reaches these stages in full: check here,
    # without CUDA, that each stage's runner and the benchmark function it calls exist.
    from benchmarks import frontier, gpu_check, gpu_whole_step, offload_gpu

    titles = [b.title for b in gpu_check.BENCHMARKS]
    assert titles == [
        "whole-step budget", "short-op engine rows", "frontier benchmark", "offload contenders",
        "hf_models benchmark", "tune benchmark", "compiled benchmark",
    ]
    assert callable(gpu_whole_step.run_whole_step_check)
    assert {b.result for b in gpu_check.BENCHMARKS} == {"frontier", "offload", "note", "shortops"}
    for bench in gpu_check.BENCHMARKS:
        assert callable(bench.run) and bench.min_seconds_left > 0
    assert callable(frontier.run_model) and callable(offload_gpu.run_offload_contenders)
    assert (gpu_check.HERE / "hf_models.py").is_file()
    assert (gpu_check.HERE / "tune.py").is_file()
    assert gpu_check.tune_arguments(False, gpu_check.RESULTS)[-2:] == ["--device", "cuda"]


def test_benchmarks_out_of_time_are_skipped_and_a_failure_stops_no_other(monkeypatch, tmp_path):
    from benchmarks import gpu_check

    notes: list[str] = []
    assert gpu_check.run_benchmarks(True, "cpu", tmp_path, lambda: 0.0, notes) == {}
    assert notes == [f"{b.title}: skipped, out of time" for b in gpu_check.BENCHMARKS]

    def fails(ctx):
        raise RuntimeError("no such kernel")

    seen = []
    monkeypatch.setattr(gpu_check, "BENCHMARKS", (
        gpu_check.Benchmark("first", 10, "frontier", fails),
        gpu_check.Benchmark("second", 10, "offload", lambda ctx: seen.append(ctx) or {"ok": 1}),
        gpu_check.Benchmark("third", 10, "note", lambda ctx: "third: done"),
        gpu_check.Benchmark("fourth", 100, "frontier", lambda ctx: [1]),
    ))  # fmt: skip
    notes = []
    results = gpu_check.run_benchmarks(True, "cpu", tmp_path, lambda: 50.0, notes)
    assert results == {"offload": {"ok": 1}}
    assert notes == [
        "first failed: RuntimeError: no such kernel",
        "third: done",
        "fourth: skipped, out of time",
    ]
    assert seen == [gpu_check.BenchmarkRun(True, "cpu", tmp_path, 50.0)]


def test_the_compiled_stage_asks_compiled_py_for_a_few_cuda_contenders(tmp_path):
    # Parsed by compiled.py's own parser, so a renamed flag fails here, not on the GPU.
    from benchmarks import compiled, gpu_check

    args = compiled.parser().parse_args(gpu_check.compiled_arguments(False, tmp_path))
    assert args.device == "cuda" and args.models == ["llama"] and not args.quick
    assert args.budgets == [1.0, 0.7] and args.knobs == [1.0] and args.saved == [0.7]
    assert set(args.kinds) == {"compiler", "twin", "knob", "bytes"}
    assert compiled._sizes(args) is compiled.GPU
    dry = compiled.parser().parse_args(gpu_check.compiled_arguments(True, tmp_path))
    assert dry.quick and dry.device == "cpu"


def test_the_short_op_rows_run_in_a_cpu_dry_run_and_render():
    # The GPU run times them eagerly and as CUDA graphs; here the same code at tiny sizes.
    from benchmarks import gpu_check
    from benchmarks.shortops_gpu import run_shortops

    data = run_shortops(True, "cpu", lambda line: None)
    (short,) = data.values()
    assert short["graphs"] == {"skipped": "CUDA graphs need a CUDA device (CPU dry run)"}
    assert set(short["targets"]) == {
        "gradckpt_full_over_torch_full", "gradckpt_selective_over_torch_sac",
        "fit_plain_over_plain",
    }
    text = gpu_check.report("cpu-dry-run", [], [], [], {"date": "d", "dry_run": True},
                            shortops=data)  # fmt: skip
    assert "## The engine where ops are short" in text
    assert "`gradckpt_selective`" in text and "CUDA graphs of the whole step" in text
