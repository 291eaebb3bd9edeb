"""Argument types and the flags every ``gradckpt`` subcommand shares.

Their own module so that a subcommand's parser (``cli/tune.py``) uses them
without importing the package that builds the whole parser.

Example:
    >>> parser.add_argument("--budget", type=budget_type)
    >>> common_flags(parser)
"""

from __future__ import annotations

import argparse

__all__ = ["budget_type", "common_flags", "positive_int", "positive_ints"]


def budget_type(text: str):
    """An argparse type: a budget as ``gradckpt`` commands read it (bytes, units, fraction, auto)."""
    from gradckpt.cli.common import budget_arg

    return budget_arg(text)


def positive_ints(what: str, example: str):
    """An argparse type: whole numbers >= 1 separated by commas, named ``what`` in errors."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or any(n < 1 for n in values):
            raise argparse.ArgumentTypeError(
                f"expected {what} separated by commas (e.g. {example}), got {text!r}"
            )
        return values

    return parse


def positive_int(what: str):
    """An argparse type: one whole number >= 1, ``what`` it counts named in errors."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{what} are a whole number >= 1, got {text!r}")
        return n

    return parse


def common_flags(p: argparse.ArgumentParser, threads: int | None = None, why: str = "") -> None:
    """``--threads`` and ``--debug``, which every subcommand has."""
    default = f"{threads}{why}" if threads else "torch's own choice"
    p.add_argument(
        "--threads", type=int, default=threads, help=f"torch CPU threads (default: {default})"
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
