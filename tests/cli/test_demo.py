"""``gradckpt demo``: runs end to end at a few steps and writes the frontier PNG, plan and numbers."""

from __future__ import annotations

import json

import pytest

import gradckpt

from .conftest import assert_ok, gradckpt_cli


def test_demo_runs_and_writes_png_plan_and_numbers(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    proc = gradckpt_cli("demo", "--steps", "3", "--out", str(out), "--threads", "1")
    assert_ok(proc)
    png = out / "frontier.png"
    assert png.is_file() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gradckpt.Plan.load(out / "plan.json")  # a plan the library accepts
    report = json.loads((out / "demo.json").read_text())
    assert report["losses_identical"] is True
    assert len(report["plain_losses"]) == 3
    assert report["planned_peak_bytes"] <= report["budget_bytes"]
    assert report["budget_bytes"] <= report["plain_peak_bytes"] // 2 + 1  # the default: half
    for text in ("[1/4]", "[2/4]", "[3/4]", "[4/4]", "identical", "within the budget"):
        assert text in proc.stdout
    assert proc.stderr == ""


def test_demo_without_matplotlib_prints_the_table_and_how_to_get_the_plot(
    tmp_path, monkeypatch, capsys
):
    # In-process (what the console script runs), to spare a second torch start-up.
    import torch

    from gradckpt.cli import main

    monkeypatch.setenv("GRADCKPT_HIDE_EXTRAS", "matplotlib,rich")
    threads = torch.get_num_threads()
    out = tmp_path / "demo"
    try:
        code = main(
            ["demo", "--steps", "1", "--out", str(out), "--threads", "1", "--budget", "0.7"]
        )
    finally:
        torch.set_num_threads(threads)
    text = capsys.readouterr().out
    assert code == 0, text
    assert not (out / "frontier.png").exists()
    assert "memory-time frontier" in text
    assert "pip install 'gradckpt[plot]'" in text
