"""``gradckpt tune``: the candidate table, the plan written, --json, --plot, one-line errors."""

from __future__ import annotations

import json
import os

import pytest

import gradckpt
from gradckpt.cli import main

from .conftest import assert_ok, assert_one_line_error, gradckpt_cli

BUDGET = "16MiB"  # tiny-gpt with AdamW: the plain micro-batch of 8 and 16 do not fit


def test_table_plan_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    proc = gradckpt_cli("tune", "tiny-gpt", "--budget", BUDGET, "--global-batch", "16",
                        "--rounds", "2", "--plot", "tune.png", cwd=tmp_path)  # fmt: skip
    assert_ok(proc)
    out = proc.stdout
    for phase in ("[1/3] building tiny-gpt", "[2/3] tuning tiny-gpt", "[3/3] predicted 15"):
        assert phase in out
    assert "gradckpt tune: budget 16.00 MiB; chosen micro-batch" in out
    for b in ("1", "2", "4", "8", "16"):  # every divisor, under every strategy
        for strategy in ("none", "per-layer", "gradckpt"):
            assert any(line.split()[:3] == [b, str(16 // int(b)), strategy]
                       for line in out.splitlines()), (b, strategy)  # fmt: skip
    assert "over budget (predicted)" in out
    assert sum(line.endswith("  chosen") for line in out.splitlines()) == 1
    assert "wrote plan.json and tune.png" in out and "gradckpt.Plan.load('plan.json')" in out
    plan = gradckpt.Plan.load(tmp_path / "plan.json")
    assert plan.budget_bytes == 16 << 20 and plan.predicted_peak_bytes <= 16 << 20
    assert plan.step is not None and plan.step.optimizer_state > 0  # AdamW counted
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json(tmp_path):
    proc = gradckpt_cli("tune", "tiny-gpt", "--budget", BUDGET, "--global-batch", "8",
                        "--batch-sizes", "2,4,8", "--rounds", "1", "--out", "out/p.json",
                        "--json", cwd=tmp_path)  # fmt: skip
    assert_ok(proc)
    data = json.loads(proc.stdout)  # nothing but the document on stdout
    assert data["kind"] == "gradckpt.TuneResult" and data["target"] == "tiny-gpt"
    assert data["global_batch"] == 8 and data["budget_bytes"] == 16 << 20
    assert data["micro_batch"] * data["accumulation_steps"] == 8
    assert data["plan_path"] == "out/p.json" and data["plot_path"] is None
    assert {c["micro_batch"] for c in data["candidates"]} == {2, 4, 8}
    chosen = [c for c in data["candidates"] if c["verdict"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["measured_samples_per_s"] > 0
    assert chosen[0]["measured_peak_bytes"] <= 16 << 20
    assert gradckpt.Plan.load(tmp_path / "out" / "p.json").to_json() == data["plan"]


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--global-batch", "0"], ["--global-batch", "whole number", "'0'"]),
        (["--global-batch", "eight"], ["--global-batch", "'eight'"]),
        (["--global-batch", "8", "--batch-sizes", "3,4"], ["[3] do not divide", "8"]),
        (["--global-batch", "8", "--budget", "0.5"], ["bytes", "fraction"]),
        (["--budget", BUDGET], ["--global-batch"]),  # required
        # Bounded inputs (#40): each refused at once, before anything is built or profiled.
        (["--global-batch", str(10**12)], ["--global-batch", "1048576", str(10**12)]),
        (["--global-batch", "1000003"], ["--global-batch 1000003", "1000002", "1000004"]),
        (["--global-batch", "8", "--batch-sizes", "8192"], ["--batch-sizes", "4096", "8192"]),
        (["--global-batch", "8", "--rounds", "0"], ["--rounds", "real runs", "'0'"]),
        (["--global-batch", "8", "--plot", "a" * 300 + ".png"], ["--plot", "cannot be written"]),
    ],
)
def test_bad_arguments_are_one_line_errors(flags, fragments, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("gradckpt.cli.tune.resolve", lambda *a, **k: pytest.fail("built"))
    budget = [] if "--budget" in flags else ["--budget", BUDGET]
    assert main(["tune", "tiny-gpt", *budget, *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("gradckpt: error: ")
    for fragment in fragments:
        assert fragment in err[0]
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_plot_in_proc_is_refused_before_profiling(capsys, monkeypatch):
    # os.access says a root process may write in /proc; writing there fails. Before #40
    # the PNG failed after the whole tuning run, with exit 1.
    monkeypatch.setattr("gradckpt.cli.tune.resolve", lambda *a, **k: pytest.fail("built"))
    assert main(["tune", "tiny-gpt", "--budget", BUDGET, "--global-batch", "4",
                 "--plot", "/proc/gradckpt-tune.png"]) == 2  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--plot '/proc/gradckpt-tune.png' cannot be written" in err[0]


def test_a_target_without_make_loss_and_a_budget_nothing_fits(tmp_path):
    (tmp_path / "two.py").write_text(
        "from gradckpt.testing import make\n\n"
        "def make_pair():\n"
        "    ex = make('mlp', blocks=2, width=16)\n"
        "    return ex.model, ex.loss_fn\n"
    )
    proc = gradckpt_cli("tune", "two.py:make_pair", "--budget", "1GiB", "--global-batch", "4",
                        cwd=tmp_path)  # fmt: skip
    assert_one_line_error(proc, "no make_loss(b)", "(model, loss_fn, make_loss)")
    proc = gradckpt_cli("tune", "tiny-gpt", "--budget", "1MiB", "--global-batch", "2", "--json",
                        cwd=tmp_path)  # fmt: skip
    line = assert_one_line_error(proc, "no micro-batch size fits 1.00 MiB", "--budget")
    assert json.loads(proc.stdout.splitlines()[-1])["error"] in line
