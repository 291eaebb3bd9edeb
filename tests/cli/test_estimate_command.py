"""``gradckpt estimate`` and ``plan --optimizer``: the whole training step, in parts, before renting.

In-process (``main``) on the small built-in ``tiny-gpt``, always under fake tensors.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from gradckpt.cli import main

PARTS = ("params", "gradients", "optimizer_state", "optimizer_step", "activations")


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(code: int, err: str, *fragments: str) -> str:
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradckpt: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture(scope="module")
def adamw_json():
    """One --json estimate with AdamW and a budget between the leanest and the plain peak."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(["estimate", "tiny-gpt", "--optimizer", "adamw", "--budget", "0.7", "--json"])
    assert code == 0
    return json.loads(buffer.getvalue())


def test_estimate_prints_each_part_the_phase_and_the_formulas(capsys):
    code, out, err = run(capsys, "estimate", "tiny-gpt", "--optimizer", "adamw")
    assert code == 0, err
    for text in (
        "parameters and buffers", "gradients", "optimizer state", "optimizer step temporaries",
        "activations, recompute, workspace", "whole-step peak", "peak set by", "forward/backward",
        "plain (no checkpointing)", "leanest plan", "AdamW", "nothing allocated",
        # the formulas, next to it, and what they leave out
        "4 + 4 + 2x4 = 16 B", "2 + 2 + 2x4 = 12 B", "no fp32 master copy",
        "2 + 2 + 2x4 + 4 = 16 B", "master copy", "leave out activations",
        "optimizer step's temporaries", "optimizer step itself peaks at",
    ):  # fmt: skip
        assert text in out, f"{text!r} not in the output:\n{out}"


def test_estimate_json_numbers_are_consistent(adamw_json):
    data = adamw_json
    params = data["parameters"]
    assert params["dtype"] == "float32" and params["trainable"] == params["count"] > 0
    for key in ("plain", "leanest"):
        part = data[key]
        assert sum(part[k] for k in PARTS) == part["total_bytes"] == part["predicted_peak_bytes"]
        assert all(isinstance(part[k], int) for k in PARTS)
    assert data["leanest"]["total_bytes"] < data["plain"]["total_bytes"]
    # AdamW on an fp32 model: two fp32 states per parameter, plus its small 'step' tensors.
    state = data["training_step"]["optimizer"]["state_bytes"]
    assert 2 * params["trainable_bytes"] <= state <= 2 * params["trainable_bytes"] * 1.01
    assert data["plain"]["optimizer_state"] == state
    as_built = data["formulas"][0]
    assert as_built["bytes_per_param"] == 16 and as_built["bytes"] == 16 * params["count"]
    assert data["formulas_leave_out"] == ["activations", "optimizer step temporaries"]
    step_peak = data["optimizer_step_peak_bytes"]
    assert step_peak == (params["bytes"] + data["gradient_bytes"] + state
                         + data["optimizer_step_temporaries_bytes"])  # fmt: skip
    budget = data["budget"]
    assert budget["plain_fits"] is False and budget["leanest_fits"] is True
    plan = budget["plan"]
    assert sum(plan[k] for k in PARTS) == plan["total_bytes"] <= budget["budget_bytes"]


def test_estimate_without_optimizer_says_it_is_not_counted(capsys):
    code, out, err = run(capsys, "estimate", "tiny-gpt")
    assert code == 0, err
    assert "optimizer is NOT counted" in out and "--optimizer NAME" in out
    assert "weights + gradients (optimizer not counted)" in out


def test_estimate_accumulation_and_zero_grads_make_gradients_resident(capsys):
    code, out, err = run(capsys, "estimate", "tiny-gpt", "--optimizer", "sgd", "--accumulation",
                         "4", "--zero-grads", "--json")  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["training_step"]["accumulation_steps"] == 4
    assert data["training_step"]["set_to_none"] is False
    assert data["plain"]["phase"] == "forward/backward, gradients resident"
    assert data["plain"]["gradients"] == data["gradient_bytes"] > 0


def test_estimate_budget_auto_prints_the_rule(capsys):
    code, out, err = run(capsys, "estimate", "tiny-gpt", "--optimizer", "adam", "--budget", "auto")
    assert code == 0, err
    assert "auto budget:" in out and "headroom" in out
    assert "plan for the budget" in out and "fits" in out


def test_estimate_budget_below_params_and_state_is_a_one_line_error(capsys):
    # tiny-gpt: 0.9 MiB of parameters and 1.8 MiB of AdamW state.
    code, out, err = run(capsys, "estimate", "tiny-gpt", "--optimizer", "adamw", "--budget", "2MiB")
    one_line_error(code, err, "tiny-gpt", "the parameters", "optimizer state", "alone exceed")
    assert "whole-step peak" not in out  # refused before the estimate is printed


def test_estimate_budget_below_the_least_peak_says_no_plan_fits(capsys):
    # Above what no plan lowers (3.9 MiB: the optimizer step), below the leanest plan (5.7 MiB).
    code, out, err = run(capsys, "estimate", "tiny-gpt", "--optimizer", "adamw", "--budget", "5MiB")
    assert code == 0, err
    assert "does NOT fit" in out and "no checkpointing plan fits" in out


def test_plan_with_optimizer_shows_the_breakdown(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "tiny-gpt", "--fake", "--budget", "8MiB", "--optimizer",
                         "adamw", "--out", str(path))  # fmt: skip
    assert code == 0, err
    for text in ("whole-step peak", "set by the forward/backward", "optimizer state",
                 "counted: AdamW", "gradients set to None"):  # fmt: skip
        assert text in out, f"{text!r} not in the output:\n{out}"
    import gradckpt

    plan = gradckpt.Plan.load(path)
    assert plan.step is not None and plan.step.optimizer_state > 0
    assert plan.predicted_peak_bytes <= 8 << 20


def test_plan_without_optimizer_says_it_is_not_counted(capsys, tmp_path):
    code, out, err = run(capsys, "plan", "tiny-gpt", "--fake", "--budget", "0.8", "--out",
                         str(tmp_path / "p.json"))  # fmt: skip
    assert code == 0, err
    assert "the optimizer is NOT counted" in out and "--optimizer NAME" in out


def test_plan_budget_below_params_and_state_is_a_one_line_error(capsys, tmp_path):
    code, _, err = run(capsys, "plan", "tiny-gpt", "--fake", "--budget", "2MiB", "--optimizer",
                       "adamw", "--out", str(tmp_path / "p.json"))  # fmt: skip
    one_line_error(code, err, "alone exceed")


@pytest.mark.parametrize("command", ["estimate", "plan"])
@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_bad_accumulation_is_a_one_line_usage_error(capsys, command, bad):
    extra = ["--budget", "0.5"] if command == "plan" else []
    code, out, err = run(capsys, command, "tiny-gpt", *extra, "--accumulation", bad)
    one_line_error(code, err, "--accumulation", "whole number >= 1", f"gradckpt {command} --help")
    assert "building" not in out  # refused before anything ran


def test_unknown_optimizer_is_a_one_line_usage_error(capsys):
    code, _, err = run(capsys, "estimate", "tiny-gpt", "--optimizer", "lion")
    one_line_error(code, err, "--optimizer", "adamw")
