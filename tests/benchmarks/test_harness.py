"""``benchmarks/harness``' run clock: what every benchmark's setup block says of its run."""

from __future__ import annotations

import os
import re
import time

from benchmarks.harness import RunClock, load_note


def test_run_clock_gives_the_loads_and_the_wall_time_since_it_started():
    clock = RunClock.start()
    time.sleep(0.2)
    info = clock.info()
    assert list(info) == ["load_average_before", "load_average_after", "wall_time_s"]
    loads = re.compile(r"(\d+\.\d\d|nan) / (\d+\.\d\d|nan) / (\d+\.\d\d|nan)")
    assert loads.fullmatch(info["load_average_before"]), info
    assert loads.fullmatch(info["load_average_after"]), info
    assert 0.2 <= info["wall_time_s"] < 60


def test_a_busy_start_is_noted_in_the_report():
    busy = RunClock(load_before=(7.5, 6.0, 5.0), started=time.perf_counter())
    assert busy.info()["load_average_before"] == "7.50 / 6.00 / 5.00"
    assert "7.5" in load_note(busy.info())
    quiet = {**busy.info(), "load_average_before": "0.10 / 0.10 / 0.10"}
    quiet["load_average_after"] = "0.20 / 0.10 / 0.10"
    assert load_note(quiet) == ""


def test_the_runs_own_threads_in_the_load_after_it_are_not_a_busy_machine():
    own = {"threads": 2, "load_average_before": "0.00 / 0.07 / 0.43",
           "load_average_after": "1.51 / 1.16 / 0.83"}  # fmt: skip
    assert load_note(own) == ""
    assert "3.80" in load_note({**own, "load_average_after": "3.80 / 2.00 / 1.00"})
    assert load_note({**own, "threads": None}) != ""  # unknown threads: the load is all others'


def test_results_record_the_environment_that_changes_step_times(monkeypatch) -> None:
    from benchmarks.harness import SPEED_VARIABLES, machine_info

    for key in list(os.environ):
        if key.startswith(SPEED_VARIABLES):
            monkeypatch.delenv(key)
    assert "environment" not in machine_info()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    monkeypatch.setenv("UNRELATED_SETTING", "1")
    assert machine_info()["environment"] == {"MALLOC_MMAP_THRESHOLD_": "33554432"}


def test_a_second_run_of_the_day_gets_its_own_files(tmp_path):
    from benchmarks.harness.results import write_results

    first = write_results(tmp_path, "demo", "# one", {"run": 1}, date="2026-12-05")
    second = write_results(tmp_path, "demo", "# two", {"run": 2}, date="2026-12-05")
    assert [p.name for p in first] == ["demo-cpu-2026-12-05.md", "demo-cpu-2026-12-05.json"]
    assert [p.name for p in second] == ["demo-cpu-2026-12-05-b.md", "demo-cpu-2026-12-05-b.json"]
    assert first[0].read_text() == "# one\n"
    again = write_results(tmp_path, "demo", "# three", {"run": 1}, date="2026-12-05", overwrite=True)
    assert again == first and first[0].read_text() == "# three\n"
