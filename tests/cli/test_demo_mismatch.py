"""The demo says in one line when its measured overhead is more than 10 points off the
prediction (issue #31): the plan was chosen on numbers that did not hold."""

from __future__ import annotations

from types import SimpleNamespace

from gradckpt.cli.demo import Run, _report, overhead_mismatch
from gradckpt.cli.output import Out


def test_within_ten_points_says_nothing():
    assert overhead_mismatch(0.282, 0.288) is None
    assert overhead_mismatch(0.30, 0.40) is None  # exactly 10 points: within
    assert overhead_mismatch(0.30, None) is None  # nothing measured


def test_more_than_ten_points_names_both_numbers_and_the_side():
    above = overhead_mismatch(0.244, 0.373)
    assert above is not None and "\n" not in above
    assert "+37.3%" in above and "+24.4%" in above and "12.9 points above" in above
    below = overhead_mismatch(0.40, 0.25)
    assert below is not None and "15.0 points below" in below


def _runs(plain_s: float, planned_s: float) -> list[Run]:
    runs = []
    for name, seconds in (("plain", plain_s), ("planned", planned_s)):
        run = Run(name, example=None, optimizer=None, losses=[5.0, 4.0], times=[seconds] * 3)
        run.peak = 100 if name == "plain" else 40
        runs.append(run)
    return runs


def _demo_report(capsys, predicted: float, planned_s: float) -> tuple[dict, str]:
    plan = SimpleNamespace(budget_bytes=50, predicted_peak_bytes=40, predicted_overhead=predicted)
    prof = SimpleNamespace(measured_peak_bytes=100)
    report = _report(Out(fancy=False), _runs(1.0, planned_s), plan, prof, least=30, steps=2)
    return report, capsys.readouterr().out


def test_the_demo_report_prints_the_mismatch_line_only_when_off(capsys):
    report, text = _demo_report(capsys, predicted=0.244, planned_s=1.373)
    lines = [line for line in text.splitlines() if "points above the predicted" in line]
    assert len(lines) == 1, text
    assert report["overhead_mismatch"] == lines[0]
    assert report["ok"]  # a warning, not a failure: the peak and the losses are what it proves

    report, text = _demo_report(capsys, predicted=0.282, planned_s=1.288)
    assert "points above" not in text and "points below" not in text
    assert report["overhead_mismatch"] is None
