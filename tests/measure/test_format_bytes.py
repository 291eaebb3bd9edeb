"""The one byte formatter: largest binary unit, and a round-up form that reads back as a budget."""

import pytest

from gradckpt.measure.memory import format_bytes
from gradckpt.planning.solving.budget import parse_budget


def test_format_bytes_uses_the_largest_unit():
    assert format_bytes(0) == "0 B"
    assert format_bytes(2048) == "2.00 KiB"
    assert format_bytes(5 << 30) == "5.00 GiB"
    assert format_bytes(None) == "n/a"


@pytest.mark.parametrize("nbytes", [1, 1023, 1025, 4108808, 5 * 2**30 + 1, 3 << 20])
def test_rounded_up_text_read_back_as_a_budget_is_never_less(nbytes):
    written = format_bytes(nbytes, round_up=True)
    assert nbytes <= parse_budget(written, 0) <= nbytes * 1.01 + 1
