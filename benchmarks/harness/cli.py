"""The command line every benchmark script shares."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

import torch

from benchmarks.harness.results import RESULTS


def base_parser(description: str) -> argparse.ArgumentParser:
    """Flags every benchmark script shares."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, 1 warm-up round, 2 timed rounds (a smoke test, < 60 s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="directory for the Markdown/JSON (and PNG) results (default: %(default)s)",
    )
    p.add_argument(
        "--threads", type=int, default=2, help="torch.set_num_threads value (default: %(default)s)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="unmeasured interleaved rounds before timing (default 1)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed interleaved rounds; the median is reported (default 5, quick 2)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="re-render the report (Markdown, PNG) from a JSON an earlier run wrote; measures nothing",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="torch.manual_seed before every step (default: %(default)s)",
    )
    return p  # fmt: skip


def settle(args: argparse.Namespace) -> None:
    """Apply the shared flags: thread count and quick-mode defaults."""
    torch.set_num_threads(args.threads)
    if args.warmup is None:
        args.warmup = 1
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5


def unknown_models(wanted: Iterable[str], known: Iterable[str]) -> str | None:
    """The parser error for names in ``wanted`` that ``known`` (names, or a dict by name)
    lacks; None when all are known.

    Example:
        >>> if (error := unknown_models(names, SIZES)):
        ...     parser.error(error)
    """
    known = list(known)
    unknown = [m for m in wanted if m not in known]
    return f"unknown model(s) {unknown}; choose from {sorted(known)}" if unknown else None
