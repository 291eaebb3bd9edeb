"""budget="auto" (alias "device") in the one budget parser; other budgets unchanged."""

from __future__ import annotations

import pytest

from gradckpt.measure import device_memory
from gradckpt.planning.solving.budget import check_budget, parse_budget, read_budget


@pytest.mark.parametrize("text", ["auto", "AUTO", " Auto ", "device", "Device\n", " DEVICE"])
def test_auto_and_device_read_as_the_device_kind(text: str) -> None:
    assert read_budget(text) == ("device", 0.0)
    check_budget(text)


def test_parse_needs_the_device_bytes() -> None:
    with pytest.raises(ValueError, match=r"device.*needed.*device_memory.*in bytes"):
        parse_budget("auto", 1000)
    assert parse_budget("auto", 1000, device_bytes=12345) == 12345
    assert parse_budget("device", 0, device_bytes=0) == 0


def test_device_bytes_leave_other_budgets_alone() -> None:
    assert parse_budget("50%", 1000, device_bytes=7) == 500
    assert parse_budget("1KiB", 1000, device_bytes=7) == 1024
    assert parse_budget(800, 0, device_bytes=7) == 800
    assert parse_budget("1.5GiB", 0) == 1610612736  # the docstring example, unchanged


def test_measured_device_budget_parses() -> None:
    measured = device_memory("cpu").budget_bytes
    assert parse_budget("auto", 0, device_bytes=measured) == measured > 0


@pytest.mark.parametrize("bad", ["autos", "auto5", "auto%", "au to", "devices", "auto GiB"])
def test_near_misses_stay_bad_and_name_auto(bad: str) -> None:
    with pytest.raises(ValueError, match=r"bad budget.*'auto' \(alias 'device'\).*headroom"):
        check_budget(bad)
