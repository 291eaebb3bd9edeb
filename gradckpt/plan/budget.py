"""Budgets: bytes, strings with units, or a fraction of the plain peak."""

from __future__ import annotations

import re

__all__ = ["BudgetError", "parse_budget"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)
_FORMS = (
    "a budget is bytes (an int such as 800_000_000), a string with units ('800MB', "
    "'1.5GiB', '12 GB'; case-insensitive; KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024), "
    "or a fraction of the uncheckpointed peak: a float in (0, 1] such as 0.5, or '50%'"
)


def _number(text: str, original: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{_FORMS}; got {original!r}") from None


class BudgetError(ValueError):
    """No plan fits the budget; ``least_peak_bytes`` is the smallest peak reachable."""

    def __init__(self, message: str, least_peak_bytes: int | None = None) -> None:
        super().__init__(message)
        self.least_peak_bytes = least_peak_bytes


def parse_budget(budget: int | float | str, plain_peak_bytes: int) -> int:
    """The budget in bytes.

    Example:
        >>> parse_budget("1.5GiB", 0), parse_budget(0.5, 1000), parse_budget(800, 0)
        (1610612736, 500, 800)
    """
    if isinstance(budget, bool):
        raise ValueError(f"{_FORMS}; got {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"{_FORMS}; got {budget} bytes")
        return budget
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"{_FORMS}; got the float {budget} (floats are fractions)")
        return int(budget * plain_peak_bytes)
    if isinstance(budget, str):
        text = budget.strip()
        if text.endswith("%"):
            return parse_budget(_number(text[:-1], budget) / 100, plain_peak_bytes)
        if "." in text and text.replace(".", "", 1).isdigit() and float(text) <= 1.0:
            return parse_budget(float(text), plain_peak_bytes)  # "0.5": a fraction
        match = _PATTERN.match(budget)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{_FORMS}; got {budget!r}")
        value = int(float(match.group(1)) * _UNITS[unit])
        if value <= 0:
            raise ValueError(f"{_FORMS}; got {budget!r}")
        return value
    raise ValueError(f"{_FORMS}; got a {type(budget).__name__}")
