"""The Plan as data: JSON round trip, versions, validation, summary; budgets."""

from __future__ import annotations

import json

import pytest

import gradckpt
from gradckpt.planning import Plan, Segment, UnitChoice
from gradckpt.planning.solving.budget import parse_budget


def _plan() -> Plan:
    items = (
        UnitChoice("emb"),
        Segment((UnitChoice("b.0", "recompute"), UnitChoice("b.1"))),
        UnitChoice("b.2", "selective", (1, 4), ("aten.mm.default", "aten.addmm.default")),
        UnitChoice("head"),
    )
    return Plan(items, "abc123", budget_bytes=1000, predicted_peak_bytes=900,
                baseline_peak_bytes=2000, predicted_step_time=1.2, baseline_step_time=1.0,
                solver="dp", input_shapes=(("b.0", (2, 3)),))  # fmt: skip


def test_json_round_trip(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    data = json.loads(path.read_text())
    assert data["kind"] == "gradckpt.Plan" and data["version"] == 1
    assert abs(plan.predicted_overhead - 0.2) < 1e-12


def test_other_versions_and_kinds_are_refused(tmp_path):
    data = _plan().to_json()
    with pytest.raises(ValueError, match="version 99"):
        Plan.from_json({**data, "version": 99})
    with pytest.raises(ValueError, match="not a gradckpt plan"):
        Plan.from_json({**data, "kind": "other"})


def test_invalid_items_are_refused():
    with pytest.raises(ValueError, match="mode"):
        UnitChoice("x", "sometimes")
    with pytest.raises(ValueError, match="only selective"):
        UnitChoice("x", "keep", (1,), ("aten.mm.default",))
    with pytest.raises(ValueError, match="at least two"):
        Segment((UnitChoice("x"),))


def test_summary_names_every_unit_and_the_numbers():
    text = _plan().summary()
    for token in ("b.0", "b.1", "b.2", "head", "segment", "selective", "recompute", "+20.0%"):
        assert token in text


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (800, 800),
        ("800MB", 800_000_000),
        ("800mb", 800_000_000),
        ("1.5GiB", int(1.5 * 2**30)),
        ("12 GB", 12_000_000_000),
        ("64KiB", 65536),
        ("2048", 2048),
        (0.5, 500),
        (1.0, 1000),
        ("0.5", 500),
        ("50%", 500),
        ("100%", 1000),
    ],
)
def test_budget_forms(budget, expected):
    assert parse_budget(budget, 1000) == expected


@pytest.mark.parametrize(
    "bad", ["", "lots", "12 parsecs", "-3MB", 0, -5, 1.5, 0.0, True, None, [1]]
)
def test_bad_budgets_name_the_accepted_forms(bad):
    with pytest.raises(ValueError, match=r"'800MB'.*fraction"):
        parse_budget(bad, 1000)


def test_plan_refuses_a_bad_budget_before_anything_else():
    from gradckpt.testing import make

    ex = make("mlp")
    with pytest.raises(ValueError, match="800MB"):
        gradckpt.plan(ex.model, ex.loss_fn, "a lot")
