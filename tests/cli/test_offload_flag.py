"""``gradckpt plan/explain --offload [GB/S] --host-budget``."""

from __future__ import annotations

import json

import gradckpt

from .conftest import assert_ok, assert_one_line_error, gradckpt_cli


def test_plan_with_offload_writes_the_link_into_the_plan(tmp_path):
    out = tmp_path / "p.json"
    proc = gradckpt_cli(
        "plan", "tiny-gpt", "--budget", "0.75", "--offload", "400", "--host-budget", "64MiB",
        "--out", str(out), "--json", "--threads", "1", "--repeats", "1",
    )  # fmt: skip
    assert_ok(proc)
    data = json.loads(proc.stdout)
    plan = gradckpt.Plan.load(out)
    assert plan.offload == gradckpt.OffloadOptions(
        d2h_bandwidth=400e9, h2d_bandwidth=400e9, host_budget=64 * 2**20
    )
    assert data["predicted_peak_bytes"] <= data["budget_bytes"]


def test_explain_with_offload_names_the_moved_tensors():
    proc = gradckpt_cli(
        "explain", "tiny-gpt", "--budget", "0.75", "--offload", "--threads", "1",
        "--repeats", "1",
    )  # fmt: skip
    assert_ok(proc)
    assert "offloaded to host after blocks.0's forward" in proc.stdout


def test_host_budget_without_offload_is_one_clear_error():
    proc = gradckpt_cli("plan", "tiny-gpt", "--budget", "0.5", "--host-budget", "1GiB")
    assert_one_line_error(proc, "--host-budget needs --offload")


def test_offload_with_a_baseline_solver_is_one_clear_error():
    proc = gradckpt_cli("plan", "tiny-gpt", "--budget", "0.5", "--offload", "--solver", "sqrt",
                        "--threads", "1", "--repeats", "1")  # fmt: skip
    assert_one_line_error(proc, "--offload works with --solver dp")
