"""A malformed plan file is one PlanFormatError that names the file and the field."""

from __future__ import annotations

import json

import pytest

import gradckpt
from gradckpt.planning import Plan, Segment, UnitChoice


def _saved(tmp_path):
    plan = Plan(
        (UnitChoice("a"), Segment((UnitChoice("b", "recompute"), UnitChoice("c")))),
        "fp", budget_bytes=100, predicted_peak_bytes=90, input_shapes=(("a", (2, 3)),),
    )  # fmt: skip
    path = tmp_path / "plan.json"
    plan.save(path)
    return path, json.loads(path.read_text())


def _edit(data, edit):
    data = json.loads(json.dumps(data))
    edit(data)
    return data


CASES = {
    "not JSON": (None, "not JSON"),
    "a list": (lambda d: [d], "the document"),
    "no items": (lambda d: d.pop("items"), "items"),
    "item without path": (lambda d: d["items"][1]["segment"][0].pop("path"),
                          "items[1].segment[0].path"),
    "unknown mode": (lambda d: d["items"][0].update(mode="fast"), "items"),
    "fingerprint a number": (lambda d: d.update(fingerprint=3), "fingerprint"),
    "peak a string": (lambda d: d.update(predicted_peak_bytes="90"), "predicted_peak_bytes"),
    "bad input shape": (lambda d: d.update(input_shapes=[["a", "2x3"]]), "input_shapes[0]"),
    "compiled peak a float": (lambda d: d.update(measured_compiled_peak_bytes=1.5),
                              "measured_compiled_peak_bytes"),
    "unknown field": (lambda d: d.update(colour="red"), "'colour'"),
    "no version": (lambda d: d.pop("version"), "version"),
    "no kind": (lambda d: d.pop("kind"), "kind"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_plan_file_is_one_plan_format_error_naming_file_and_field(tmp_path, case):
    path, data = _saved(tmp_path)
    edit, field = CASES[case]
    if edit is None:
        path.write_text(path.read_text()[:-20])
    else:
        changed = _edit(data, lambda d: d.__setitem__("_", edit(d)))
        changed.pop("_")
        if case == "a list":
            changed = [data]
        path.write_text(json.dumps(changed))
    with pytest.raises(gradckpt.PlanFormatError) as info:
        Plan.load(path)
    message = str(info.value)
    assert str(path) in message and field in message, message
    assert len(message.splitlines()) == 1


def test_well_formed_file_still_loads(tmp_path):
    path, _ = _saved(tmp_path)
    assert Plan.load(path).input_shapes == (("a", (2, 3)),)


def test_measured_compiled_peak_round_trips_and_old_files_read_none(tmp_path):
    """fit(compile=True) records it; files written before the field existed lack it."""
    path, data = _saved(tmp_path)
    assert "measured_compiled_peak_bytes" in data and data["measured_compiled_peak_bytes"] is None
    data.pop("measured_compiled_peak_bytes")  # a file from before the field
    path.write_text(json.dumps(data))
    assert Plan.load(path).measured_compiled_peak_bytes is None
    measured = Plan((UnitChoice("a"),), "fp", budget_bytes=100, measured_compiled_peak_bytes=95)
    measured.save(path)
    assert Plan.load(path) == measured
    assert "measured compiled peak" in measured.summary()
