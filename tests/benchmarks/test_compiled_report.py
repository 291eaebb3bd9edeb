"""The compiled benchmark's verdict rule: paired per-round ratios, a peak no higher, median <= 1."""

from __future__ import annotations

from benchmarks.compiled_report import count, process_spread, twin_noise, verdicts
from benchmarks.harness.stats import median_interval, paired_ratios, paired_stats, pooled


def _row(kind, peak, times, **extra):
    return dict(kind=kind, peak=peak, times=times, median_s=sorted(times)[len(times) // 2], **extra)


def test_paired_ratios_follow_the_rounds_not_the_medians():
    # Round-to-round drift: both slow in the same rounds; ours is 2% faster in every round.
    theirs = [1.0, 1.5, 1.0, 1.5, 1.0]
    ours = [t * 0.98 for t in theirs]
    rows = {"compile amb=1": _row("compiler", 100, theirs), "gradckpt bytes 0.5": _row("bytes", 90, ours)}
    ratios = paired_ratios(rows["gradckpt bytes 0.5"], rows["compile amb=1"])
    assert ratios == [r / t for r, t in zip(ours, theirs)]
    ((point, chosen, ratio, verdict),) = verdicts(rows, ("bytes",))
    assert (point, verdict) == ("compile amb=1", "win")
    assert chosen.startswith("gradckpt bytes 0.5") and ratio.startswith("x0.980")


def test_a_slower_or_higher_point_loses():
    theirs = [1.0, 1.01, 0.99, 1.0, 1.02]
    rows = {
        "compile amb=0.5": _row("compiler", 100, theirs),
        "gradckpt bytes 0.6": _row("bytes", 120, [t * 0.5 for t in theirs]),  # fast, too big
        "gradckpt bytes 0.5": _row("bytes", 100, [t * 1.05 for t in theirs]),  # fits, slower
    }
    ((_, chosen, _, verdict),) = verdicts(rows, ("bytes",))
    assert chosen.startswith("gradckpt bytes 0.5") and verdict == "loss"
    rows.pop("gradckpt bytes 0.5")
    assert verdicts(rows, ("bytes",))[0][1:] == ("none with a peak this low", "", "loss")


def test_noise_is_called_when_the_interval_holds_one():
    theirs = [1.0] * 9
    ours = [0.97, 1.03, 0.98, 1.02, 0.99, 1.01, 0.96, 1.04, 1.0]
    median, low, high = median_interval([o / t for o, t in zip(ours, theirs)])
    assert low < 1.0 < high and median == 1.0
    rows = {"compile amb=1": _row("compiler", 10, theirs), "gradckpt 0.5": _row("gradckpt", 10, ours)}
    assert verdicts(rows)[0][3] == "win (within noise)"


def test_twins_report_their_ratio_against_the_original():
    rows = {
        "compile amb=1": _row("compiler", 10, [1.0, 2.0, 1.0]),
        "twin amb=1": _row("twin", 10, [1.1, 2.2, 1.1], twin_of="compile amb=1"),
    }
    ((label, text),) = twin_noise(rows)
    assert label == "twin amb=1" and text.startswith("x1.100")


def test_a_held_out_choice_is_judged_on_rounds_it_was_not_chosen_on():
    # Two candidates that tie over all rounds; one looks fast on the even rounds only.
    theirs = [1.0] * 8
    lucky = [0.90, 1.10] * 4  # fast when chosen, slow when judged
    steady = [0.99] * 8
    rows = {
        "compile amb=0.5": _row("compiler", 100, theirs),
        "gradckpt bytes 0.55": _row("bytes", 90, lucky),
        "gradckpt bytes 0.5": _row("bytes", 80, steady),
    }
    ((_, chosen, ratio, verdict),) = verdicts(rows, ("bytes",))
    assert chosen.startswith("gradckpt bytes 0.5 ") and ratio.startswith("x0.990")
    ((_, chosen, ratio, verdict),) = verdicts(rows, ("bytes",), held_out=True)
    assert chosen.startswith("gradckpt bytes 0.55") and ratio.startswith("x1.100")
    assert verdict == "loss"


def _replicated(kind, peak, replica_times, **extra):
    row = _row(kind, peak, pooled(replica_times), **extra)
    row["replica_times"] = replica_times
    return row


def test_processes_pool_by_round_and_their_spread_widens_the_interval():
    assert pooled([[1.0, 2.0], [3.0, 1.0], [2.0, 5.0]]) == [2.0, 2.0]
    assert pooled([[1.0, 2.0, 4.0], [3.0]]) == [2.0, 2.0, 4.0]  # the second process died
    rounds = 15
    theirs = [[1.0] * rounds, [1.0] * rounds, [1.0] * rounds]
    # Ours: one fast, one slow, one even process; every round alike within a process.
    ours = [[0.94] * rounds, [1.06] * rounds, [1.0] * rounds]
    rows = {"compile amb=1": _replicated("compiler", 10, theirs),
            "gradckpt knob amb=1": _replicated("knob", 10, ours)}  # fmt: skip
    median, low, high = paired_stats(rows["gradckpt knob amb=1"], rows["compile amb=1"])
    assert median == 1.0
    # Resampling the processes finds the spread the rounds alone cannot (they are constant).
    assert low <= 0.94 + 1e-9 and high >= 1.06 - 1e-9
    flat = dict(rows["gradckpt knob amb=1"])
    flat.pop("replica_times")
    assert paired_stats(flat, dict(rows["compile amb=1"], replica_times=None))[1:] == (1.0, 1.0)
    ((label, medians, spread),) = process_spread({"gradckpt knob amb=1": rows["gradckpt knob amb=1"]})
    assert label == "`gradckpt knob amb=1`"
    assert medians == "0.940 / 1.060 / 1.000" and spread == "x1.128"


def test_the_count_names_near_misses_apart_from_wins():
    table = [("a", "", "", "win"), ("b", "", "", "win (within noise)"),
             ("c", "", "", "loss (within noise)"), ("d", "", "", "loss")]  # fmt: skip
    text = count(table)
    assert text.startswith("2 of 4 compiler points met") and "1 more slower by less" in text
    assert "more slower" not in count(table[:2])
