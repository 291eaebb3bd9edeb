"""Budgets: bytes, strings with units, a fraction of the plain peak, or "auto" (device memory).

A verb reads the user's budget once (:meth:`Budget.read`) and hands the value
down: the layers below take a :class:`Budget` and never parse it again.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradckpt.measure.device import DeviceMemory
    from gradckpt.profiling.training_step import TrainingStep

__all__ = ["Budget", "BudgetError", "check_budget", "parse_budget", "read_budget"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)
_FORMS = (
    "A budget is bytes (an int such as 800_000_000), a string with units ('800MB', "
    "'1.5GiB', '12 GB'; case-insensitive; KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024); "
    "a fraction of the uncheckpointed peak: a float in (0, 1] such as 0.5, or '50%'; "
    "or 'auto' (alias 'device'): the memory of the device the model is on, less a stated "
    "headroom"
)
_DEVICE_WORDS = ("auto", "device")


def _number(text: str, original: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise _bad(original) from None


class BudgetError(ValueError):
    """No plan fits the budget; ``least_peak_bytes`` is the smallest peak reachable."""

    def __init__(self, message: str, least_peak_bytes: int | None = None) -> None:
        super().__init__(message)
        self.least_peak_bytes = least_peak_bytes


@dataclass(frozen=True)
class Budget:
    """A budget read once: what the user gave, what it means, and what it came from.

    ``kind`` is ``"bytes"`` (``value`` bytes), ``"fraction"`` (``value`` of the plain
    peak) or ``"device"`` (``"auto"`` before the device is read). ``resolve`` at the
    API makes a device budget bytes, keeping the reading (``device``: its rule and
    headroom); ``step`` is the training step the bytes hold (optimizer, accumulation).

    Example:
        >>> Budget.read("1KiB").bytes_for(0), Budget.read(0.5).bytes_for(1000)
        (1024, 500)
    """

    given: object
    kind: str
    value: float
    device: DeviceMemory | None = None
    step: TrainingStep | None = None

    @classmethod
    def read(cls, budget: object) -> Budget:
        """``budget`` as the user wrote it, parsed (a :class:`Budget` is taken as it is)."""
        if isinstance(budget, Budget):
            return budget
        if type(budget) is int and budget > 0:  # bytes already, as the layers pass them on
            return cls(budget, "bytes", budget)
        kind, value = read_budget(budget)
        return cls(budget, kind, value)

    @property
    def is_fraction(self) -> bool:
        """A share of the plain peak (of the tensors), not bytes of the device."""
        return self.kind == "fraction"

    def bytes_for(self, plain_peak_bytes: int) -> int:
        """The budget in bytes, a fraction taken of ``plain_peak_bytes``."""
        if self.kind == "device":
            return parse_budget(self.given, plain_peak_bytes)  # raises: the device is unread
        return int(self.value) if self.kind == "bytes" else int(self.value * plain_peak_bytes)


def parse_budget(
    budget: int | float | str, plain_peak_bytes: int, *, device_bytes: int | None = None
) -> int:
    """The budget in bytes.

    ``"auto"`` is ``device_bytes``, which the caller measures with
    :func:`gradckpt.measure.device.device_memory` (``.budget_bytes``).

    Example:
        >>> parse_budget("1.5GiB", 0), parse_budget(0.5, 1000), parse_budget(800, 0)
        (1610612736, 500, 800)
        >>> parse_budget("auto", 0, device_bytes=4096)
        4096
    """
    kind, value = read_budget(budget)
    if kind == "device":
        if device_bytes is None:
            raise ValueError(
                f"budget {budget!r} is the memory of the device the model is on, and that "
                "is needed here: measure it with gradckpt.measure.device.device_memory("
                "device, held_bytes=...).budget_bytes and pass it as device_bytes, or give "
                "the budget in bytes"
            )
        return int(device_bytes)
    return int(value) if kind == "bytes" else int(value * plain_peak_bytes)


def check_budget(budget: object) -> None:
    """Raise the error :func:`parse_budget` would, without knowing the plain peak.

    Lets the API refuse a bad budget before it spends time profiling.

    Example:
        >>> check_budget("50%")
    """
    read_budget(budget)


def read_budget(budget: object) -> tuple[str, float]:
    """("bytes", n), ("fraction", f) or ("device", 0.0): what the user meant, or a
    ValueError in their words.

    The one budget parser: the API, the CLI and the integrations all read budgets here.
    ``"auto"`` and ``"device"`` (any case) are the device's memory, measured later.

    Example:
        >>> read_budget("50%"), read_budget("1KiB"), read_budget("auto")
        (('fraction', 0.5), ('bytes', 1024), ('device', 0.0))
    """
    if isinstance(budget, bool) or budget is None:
        raise _bad(budget)
    if isinstance(budget, numbers.Integral):  # int, numpy integers
        if int(budget) <= 0:
            raise _bad(int(budget), "bytes must be more than 0")
        return "bytes", int(budget)
    if isinstance(budget, numbers.Real):  # float, numpy floats
        if not 0.0 < float(budget) <= 1.0:
            raise _bad(
                float(budget),
                "a float is a fraction of the plain peak, in (0, 1] (for bytes give an int "
                "or a string with units)",
            )
        return "fraction", float(budget)
    if isinstance(budget, str):
        text = budget.strip()
        if text.lower() in _DEVICE_WORDS:
            return "device", 0.0
        if text.endswith("%"):
            percent = _number(text[:-1], budget)
            if not 0.0 < percent <= 100.0:
                raise _bad(budget, "a percentage of the plain peak is in (0%, 100%]")
            return "fraction", percent / 100
        match = _PATTERN.match(text)
        if match is None:
            if _is_number(text):  # "1e9", "-3": a number, but neither whole bytes nor a fraction
                raise _bad(
                    budget,
                    "a number that is not whole bytes is a fraction of the plain peak, in "
                    "(0, 1]; for bytes give the digits or a unit ('1GB')",
                )
            raise _bad(budget)
        number, unit = match.group(1), match.group(2).lower()
        if not unit and "." in number:
            if 0.0 < float(number) <= 1.0:
                return "fraction", float(number)  # "0.5": a fraction
            raise _bad(
                budget,
                "a number with a point and no unit is a fraction of the plain peak, in (0, 1]; "
                "for bytes give a unit ('2.5GB')",
            )
        if unit not in _UNITS:
            raise _bad(budget, f"unknown unit {match.group(2)!r}")
        value = int(float(number) * _UNITS[unit])
        if value <= 0:
            raise _bad(budget)
        return "bytes", value
    raise _bad(budget, f"a {type(budget).__name__} is not a budget")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _bad(budget: object, reason: str = "") -> ValueError:
    return ValueError(f"bad budget {budget!r}" + (f": {reason}" if reason else "") + f". {_FORMS}")
