"""``gradckpt plan --shapes``: a plan set over sequence lengths, loaded and applied by the library."""

from __future__ import annotations

import json

import torch

import gradckpt

from .conftest import assert_ok, assert_one_line_error, gradckpt_cli


def test_plan_shapes_writes_a_plan_set_the_library_applies(tmp_path):
    out = tmp_path / "plans.json"
    proc = gradckpt_cli(
        "plan", "tiny-gpt", "--budget", "0.8", "--shapes", "32,48", "--out", str(out), "--json",
        "--threads", "1", "--repeats", "1",
    )  # fmt: skip
    assert_ok(proc)
    data = json.loads(proc.stdout)
    plans = gradckpt.PlanSet.load(out)
    assert gradckpt.PlanSet.from_json(data["plan_set"]) == plans and len(plans) == 3
    lengths = sorted(key.args[0].shape[1] for key, _ in plans)
    assert lengths == [32, 48, 64]  # tiny-gpt's own length and the two asked for
    assert all(p.predicted_peak_bytes <= data["budget_bytes"] for _, p in plans)
    from gradckpt.cli.targets import BUILTINS

    model, _ = BUILTINS["tiny-gpt"].build(False, "cpu")
    gradckpt.apply(model, plans)
    model(torch.zeros(4, 48, dtype=torch.long)).sum().backward()
    assert gradckpt.applied_plan(model) == plans.get(
        next(k for k, _ in plans if k.args[0].shape[1] == 48)
    )


def test_bad_shapes_are_one_line_errors(tmp_path):
    proc = gradckpt_cli("plan", "tiny-gpt", "--budget", "0.8", "--shapes", "32,x")
    assert_one_line_error(proc, "--shapes", "positive sequence lengths")
